"""Stage0 with the real audio front end: the step's batched front end (every unit prefilled in a step
through one log-mel and one encoder pass, outside the engine lock) gives the same events as the
per-session front end, for staggered sessions whose units land in the same steps (issue 15)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from engine.audio import AudioFrontEnd
from engine.stage0 import DecodeRules, Fence, Stage0Config, Stage0Engine, TokenEvent, UnitDone
from engine.stage0.frontend import AudioFrontEndAdapter
from tests.engine.test_audio_encoder import build, tiny_audio
from tests.engine.test_stage0_engine import by_session, params, run_schedule
from tests.engine.test_stage0_helpers import tiny_llm, tiny_tokenizer, unit_pcm

ATOL = 1e-5


class PerSessionFrontEnd(AudioFrontEndAdapter):
    """The same front end without `encode_units`: the engine encodes each unit alone."""

    def __getattribute__(self, name: str) -> Any:
        if name == "encode_units":
            raise AttributeError(name)
        return super().__getattribute__(name)


class CountingFrontEnd(AudioFrontEndAdapter):
    def __init__(self, audio: AudioFrontEnd) -> None:
        super().__init__(audio)
        self.batches: list[int] = []
        self.lock_held: list[bool] = []
        self.engine: Stage0Engine | None = None

    def encode_units(self, states: list[Any], pcms: list[torch.Tensor]) -> list[torch.Tensor]:
        self.batches.append(len(states))
        if self.engine is not None:  # the engine lock is free while the front end runs
            self.lock_held.append(not _free_for_others(self.engine.lock))
        return super().encode_units(states, pcms)


def _free_for_others(lock: Any) -> bool:
    """Can another thread take `lock` now? (An RLock is always free for the thread that holds it.)"""
    result: list[bool] = []

    def probe() -> None:
        ok = lock.acquire(blocking=False)
        if ok:
            lock.release()
        result.append(ok)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result[0]


def _engine(front: AudioFrontEndAdapter, model: torch.nn.Module) -> tuple[Stage0Engine, list]:
    events: list = []
    config = Stage0Config(max_sessions=4, use_cuda_graphs=False)
    return Stage0Engine(model, tiny_tokenizer(), front, events.append, config,
                        DecodeRules(force_listen_count=1)), events


def _audio() -> AudioFrontEnd:
    """The tiny front end with an audio-KV slot for each of the engine's sessions (max_sessions = 4)."""
    enc, proj = build(1500, seed=3)
    return AudioFrontEnd(enc, proj, tiny_audio(1500), kv_slots=4)


def test_batched_front_end_equals_per_session_front_end() -> None:
    model = tiny_llm()
    arrivals = {f"s{i}": 0 if i < 2 else 7 * (i - 1) for i in range(4)}  # units of several sessions share steps
    batched_front = CountingFrontEnd(_audio())
    batched, got = _engine(batched_front, model)
    batched_front.engine = batched
    run_schedule(batched, arrivals, units=5)
    solo, want = _engine(PerSessionFrontEnd(_audio()), model)
    run_schedule(solo, arrivals, units=5)
    assert max(batched_front.batches) > 1  # some steps encoded several sessions' units together
    assert not any(batched_front.lock_held)
    for sid in arrivals:
        a, b = by_session(got, sid), by_session(want, sid)
        assert [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in a] == \
            [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in b]
        for x, y in zip(a, b, strict=True):
            if isinstance(x, TokenEvent) and x.hidden is not None:
                torch.testing.assert_close(x.hidden, y.hidden, atol=ATOL, rtol=ATOL)
        assert sum(isinstance(e, UnitDone) for e in a) == 5


def _signature(events: list) -> list[tuple]:
    return [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in events]


def _close_and_reuse(engine: Stage0Engine, pool_free: Any) -> list[int]:
    """Four sessions fill the engine; s0 closes after two units; s4 opens in its place and streams next to
    s1..s3, which are further on (staggered caches). Returns the pool's free slots after each phase."""
    free: list[int] = []
    for i in range(4):
        engine.open(f"s{i}", Fence(1, 0), params=params(i))
    for k in range(2):
        for i in range(4):
            engine.append(f"s{i}", Fence(1, 0, seq=k), unit_pcm(i, k))
        engine.run_until_idle()
    free.append(pool_free())
    assert engine.close("s0", Fence(1, 0))
    free.append(pool_free())
    engine.open("s4", Fence(1, 0), params=params(4))
    free.append(pool_free())
    for k in range(3):
        engine.append("s4", Fence(1, 0, seq=k), unit_pcm(4, k))
        for i in (1, 2, 3):
            engine.append(f"s{i}", Fence(1, 0, seq=2 + k), unit_pcm(i, 2 + k))
        engine.run_until_idle()
        free.append(pool_free())
    return free


def test_a_closed_session_s_audio_kv_slot_serves_the_next_session() -> None:
    """The audio KV slot (and mel slot) of a closed session is free once nothing holds the session (HistoryRing holds its
    owner weakly), so the session opened in its place gets the slot (at once, or at its next batch after a
    private cache); its units equal the per-session front end's throughout, beside sessions further on in
    their streams."""
    model = tiny_llm()
    front = CountingFrontEnd(_audio())
    batched, got = _engine(front, model)
    free = _close_and_reuse(batched, lambda: (front.audio.kv_pool.free, front.audio.streamer.pool.free))
    assert free[0] == (0, 0) and free[-1] == (0, 0)
    states = [batched.session(f"s{i}").frontend_state for i in range(1, 5)]
    assert all(s.kv.pool is front.audio.kv_pool for s in states) and len({s.kv.slot for s in states}) == 4
    # the mel samples too: s4 streams in s0's mel slot (its window and pending PCM in the pool's ring)
    assert all(s.mel.pool is front.audio.streamer.pool for s in states) and len({s.mel.slot for s in states}) == 4
    solo, want = _engine(PerSessionFrontEnd(_audio()), model)
    _close_and_reuse(solo, lambda: 0)
    assert max(front.batches) == 4
    for sid in ("s0", "s1", "s2", "s3", "s4"):
        a, b = by_session(got, sid), by_session(want, sid)
        assert _signature(a) == _signature(b) and sum(isinstance(e, UnitDone) for e in a) == (2 if sid == "s0" else 5
                                                                                            if sid != "s4" else 3)
        for x, y in zip(a, b, strict=True):
            if isinstance(x, TokenEvent) and x.hidden is not None:
                torch.testing.assert_close(x.hidden, y.hidden, atol=ATOL, rtol=ATOL)


def test_failed_front_end_batch_fails_its_units_only() -> None:
    class Broken(AudioFrontEndAdapter):
        def encode_units(self, states: list[Any], pcms: list[torch.Tensor]) -> list[torch.Tensor]:
            raise RuntimeError("front end down")

    engine, events = _engine(Broken(_audio()), tiny_llm())
    engine.open("a", Fence(1, 0), params=params(1))
    engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0))
    engine.run_until_idle()
    done = [e for e in events if isinstance(e, UnitDone)]
    assert len(done) == 1 and done[0].aborted and "front end down" in (done[0].error or "")
    engine.append("a", Fence(1, 0, seq=1), unit_pcm(1, 1))  # the engine goes on
    engine.run_until_idle()
    assert len([e for e in events if isinstance(e, UnitDone)]) == 2
