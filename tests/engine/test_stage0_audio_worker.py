"""Stage0 with the audio front end on its own thread (engine/stage0/audio_worker.py): the same events as
the front end in the step, other sessions' rows go on while a unit's audio is encoded, and a failed or
orphaned batch costs only its own units."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from engine.stage0 import Fence, TokenEvent, UnitDone
from engine.stage0.frontend import AudioFrontEndAdapter
from engine.stage0.session import Phase
from tests.engine.test_stage0_batched_frontend import PerSessionFrontEnd, _audio, _engine
from tests.engine.test_stage0_engine import by_session, params, run_schedule
from tests.engine.test_stage0_helpers import tiny_llm, unit_pcm

ATOL = 1e-5


class GatedFrontEnd(AudioFrontEndAdapter):
    """`encode_units` waits for `gate` (the test holds a unit in the worker) and records its threads."""

    def __init__(self) -> None:
        super().__init__(_audio())
        self.gate = threading.Event()
        self.gate.set()
        self.threads: set[str] = set()

    def encode_units(self, states: list[Any], pcms: list[torch.Tensor]) -> list[torch.Tensor]:
        self.threads.add(threading.current_thread().name)
        assert self.gate.wait(30), "the test never opened the gate"
        return super().encode_units(states, pcms)


def _signature(events: list) -> list[tuple]:
    return [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in events]


def test_worker_gives_the_events_of_the_front_end_in_the_step() -> None:
    model = tiny_llm()
    arrivals = {f"s{i}": 0 if i < 2 else 7 * (i - 1) for i in range(4)}
    front = GatedFrontEnd()
    engine, got = _engine(front, model)
    assert engine.start_audio_worker()
    try:
        run_schedule(engine, arrivals, units=5)
    finally:
        engine.stop_audio_worker()
    solo, want = _engine(PerSessionFrontEnd(_audio()), model)
    run_schedule(solo, arrivals, units=5)
    assert front.threads == {"stage0-audio"}  # never on the engine's thread
    for sid in arrivals:
        a, b = by_session(got, sid), by_session(want, sid)
        assert _signature(a) == _signature(b)
        for x, y in zip(a, b, strict=True):
            if isinstance(x, TokenEvent) and x.hidden is not None:
                torch.testing.assert_close(x.hidden, y.hidden, atol=ATOL, rtol=ATOL)
        assert sum(isinstance(e, UnitDone) and not e.aborted for e in a) == 5


def test_other_sessions_rows_go_on_while_a_unit_is_in_the_worker() -> None:
    front = GatedFrontEnd()
    engine, events = _engine(front, tiny_llm())
    engine.open("b", Fence(1, 0), params=params(2))
    engine.run_until_idle()  # b's system prefix
    assert engine.start_audio_worker()
    try:
        front.gate.clear()
        engine.open("a", Fence(1, 0), params=params(1))
        engine.append("b", Fence(1, 0, seq=0), unit_pcm(2, 0))
        assert engine.step()  # b's unit goes to the worker; a's prefix is fed in the same step
        assert engine.last_rows == 1
        assert engine.session("a").phase is Phase.IDLE and engine.session("a").cached_len > 0
        b = engine.session("b")
        assert b.phase is Phase.PREFILL and b.unit is not None and b.unit.audio_embeds is None
        engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0))
        assert engine.step() and engine.last_rows == 0  # a's unit waits behind b's batch: nothing to feed
        front.gate.set()
        engine.run_until_idle()
    finally:
        engine.stop_audio_worker()
    done = {e.session_id: e for e in events if isinstance(e, UnitDone)}
    assert set(done) == {"a", "b"} and not any(e.aborted for e in done.values())
    assert engine.audio_worker is None


def test_a_failed_batch_in_the_worker_fails_its_units_and_the_engine_goes_on() -> None:
    class Flaky(GatedFrontEnd):
        fail = True

        def encode_units(self, states: list[Any], pcms: list[torch.Tensor]) -> list[torch.Tensor]:
            if self.fail:
                self.fail = False
                raise RuntimeError("front end down")
            return super().encode_units(states, pcms)

    engine, events = _engine(Flaky(), tiny_llm())
    engine.start_audio_worker()
    try:
        engine.open("a", Fence(1, 0), params=params(1))
        engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0))
        engine.run_until_idle()
        engine.append("a", Fence(1, 0, seq=1), unit_pcm(1, 1))
        engine.run_until_idle()
    finally:
        engine.stop_audio_worker()
    done = [e for e in events if isinstance(e, UnitDone)]
    assert len(done) == 2
    assert done[0].aborted and "front end down" in (done[0].error or "")
    assert not done[1].aborted


def test_a_session_closed_while_its_unit_is_in_the_worker_leaves_the_others_alone() -> None:
    front = GatedFrontEnd()
    engine, events = _engine(front, tiny_llm())
    engine.start_audio_worker()
    try:
        engine.open("a", Fence(1, 0), params=params(1))
        engine.open("b", Fence(1, 0), params=params(2))
        engine.run_until_idle()
        front.gate.clear()
        engine.append("b", Fence(1, 0, seq=0), unit_pcm(2, 0))
        engine.step()  # b's unit is in the worker
        assert engine.close("b", Fence(1, 0))
        front.gate.set()
        engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0))
        engine.run_until_idle()
    finally:
        engine.stop_audio_worker()
    assert [e.session_id for e in events if isinstance(e, UnitDone)] == ["a"]
    assert not engine.has_work()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_on_its_own_cuda_stream_equals_the_front_end_on_the_default_stream() -> None:
    """Several sessions' consecutive units through the worker (its stream, record_stream, synchronize before
    publishing) give what the same front end gives on the default stream."""
    from engine.audio import AudioFrontEnd
    from engine.stage0.audio_worker import AudioWorker
    from engine.stage0.session import UnitJob, UnitRun
    from tests.engine.test_audio_encoder import build, tiny_audio

    enc, proj = build(1500, seed=3)
    fe = AudioFrontEnd(enc.cuda(), proj.cuda(), tiny_audio(1500), mel_device="cuda")
    direct = [fe.new_session() for _ in range(3)]
    threaded = [fe.new_session() for _ in range(3)]
    worker = AudioWorker(fe.encode_units, "cuda")
    worker.start()
    try:
        for k in range(4):
            pcms = [unit_pcm(i, k).float() for i in range(3)]
            want = fe.encode_units(direct, pcms)
            runs = [(state, UnitRun(job=UnitJob(fence=Fence(1, 0), index=k, pcm=p, frames=(),
                                                 force_listen_override=False), index=k, start_len=0,
                                    started_at=0.0, params=params(0)))
                    for state, p in zip(threaded, pcms, strict=True)]
            worker.submit(runs)
            while worker.busy():
                worker.wait(5.0)
            for (_, unit), w in zip(runs, want, strict=True):
                assert isinstance(unit.audio_embeds, torch.Tensor)
                torch.testing.assert_close(unit.audio_embeds, w, atol=1e-5, rtol=1e-5)
    finally:
        worker.stop()
