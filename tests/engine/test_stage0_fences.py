"""Cancel-fence rules (protocol.md §4.4 F-1..F-5) and typed errors that leave every session consistent."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.stage0 import (
    BadAudioError,
    DecodeRules,
    Fence,
    InvalidFenceError,
    SamplingParams,
    SessionClosedError,
    SessionExistsError,
    StaleFenceError,
    TokenEvent,
    TooManyFramesError,
    UnitDone,
    UnknownSessionError,
)
from engine.stage0.session import Phase
from tests.engine.test_stage0_engine import make_engine, params
from tests.engine.test_stage0_helpers import unit_pcm


def snapshot(engine, sid: str) -> tuple:
    s = engine.session(sid)
    k = engine.runner.kv.k[0][s.slot].clone()
    return (s.fence, s.last_seq, s.appended, len(s.queue), s.cached_len, s.phase, len(s.ledger), tuple(s.history),
            s.stream.consumed, k)


def same(a: tuple, b: tuple) -> bool:
    return a[:-1] == b[:-1] and torch.equal(a[-1], b[-1])


def opened(n: int = 2, **kw):
    engine, events = make_engine(**kw)
    for i in range(n):
        engine.open(f"s{i}", Fence(1, 0), params=params(i))
    engine.run_until_idle()
    return engine, events


def test_bad_inputs_raise_typed_errors_and_change_nothing() -> None:
    engine, _ = opened()
    engine.append("s0", Fence(1, 0, seq=0), unit_pcm(0, 0))
    engine.run_until_idle()
    before = {sid: snapshot(engine, sid) for sid in ("s0", "s1")}
    bad = [
        (BadAudioError, lambda: engine.append("s0", Fence(1, 0, seq=1), torch.zeros(16480))),  # unit 1 is 16,000
        (BadAudioError, lambda: engine.append("s1", Fence(1, 0, seq=0), torch.zeros(16240))),  # unit 0 is 16,480
        (BadAudioError, lambda: engine.append("s0", Fence(1, 0, seq=1), torch.zeros(2, 8000))),
        (TooManyFramesError, lambda: engine.append("s0", Fence(1, 0, seq=1), unit_pcm(0, 1), [torch.ones(64)] * 3)),
        (StaleFenceError, lambda: engine.append("s0", Fence(1, 0, seq=0), unit_pcm(0, 1))),  # replayed seq
        (StaleFenceError, lambda: engine.append("s0", Fence(2, 0, seq=5), unit_pcm(0, 1))),  # other incarnation
        (InvalidFenceError, lambda: engine.append("s0", Fence(1, 1, seq=5), unit_pcm(0, 1))),  # never adopted
        (UnknownSessionError, lambda: engine.append("nope", Fence(1, 0, seq=1), unit_pcm(0, 1))),
        (InvalidFenceError, lambda: engine.cancel("s0", Fence(1, 0), Fence(1, 2))),
        (InvalidFenceError, lambda: engine.cancel("s0", Fence(1, 0), Fence(2, 1))),
        (InvalidFenceError, lambda: engine.cancel("s0", Fence(1, 3), Fence(1, 4))),
        (SessionExistsError, lambda: engine.open("s0", Fence(1, 0))),
        (StaleFenceError, lambda: engine.update("s0", Fence(0, 0), params=SamplingParams())),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
        for sid in before:
            assert same(snapshot(engine, sid), before[sid]), error
    assert engine.close("s0", Fence(9, 0)) is False  # a stale close is a no-op
    assert engine.close("s0", Fence(1, 0)) is True
    with pytest.raises(SessionClosedError):
        engine.append("s0", Fence(1, 0, seq=1), unit_pcm(0, 1))
    assert engine.close("s0", Fence(1, 0)) is False
    assert same(snapshot(engine, "s1"), before["s1"])
    engine.open("s2", Fence(1, 0))  # the freed slot is reused
    assert engine.session("s2").slot == 0


def test_cancel_adopts_next_fence_and_rejects_old_epoch_forever() -> None:
    engine, events = opened(rules=DecodeRules(force_listen_count=0))
    engine.append("s0", Fence(1, 0, seq=0), unit_pcm(0, 0))
    engine.append("s0", Fence(1, 0, seq=1), unit_pcm(0, 1))  # queued behind unit 0
    for _ in range(50):  # run until unit 0 decodes tokens with the turn open
        engine.step()
        s = engine.session("s0")
        if s.phase is Phase.FEED and not s.turn.current_turn_ended:
            break
    assert s.phase is Phase.FEED
    n_events = len(events)
    assert engine.cancel("s0", Fence(1, 0), Fence(1, 1)) is True
    assert engine.cancel("s0", Fence(1, 0), Fence(1, 1)) is False  # late cancel: no-op, never moves back
    assert engine.session("s0").fence.epoch == 1 and not engine.session("s0").queue
    engine.run_until_idle()
    tail = events[n_events:]
    assert [type(e) for e in tail] == [UnitDone] and tail[0].aborted and tail[0].rows == ()
    assert tail[0].fence.epoch == 0
    with pytest.raises(StaleFenceError):
        engine.append("s0", Fence(1, 0, seq=9), unit_pcm(0, 1))
    s = engine.session("s0")
    assert sum(r.span for r in s.ledger) == s.owed_len - s.prefix_len
    before = s.owed_len
    engine.append("s0", Fence(1, 1, seq=2), unit_pcm(0, 1))  # unit index keeps counting: 16,000 samples
    engine.run_until_idle()
    # F-5: the turn was open, so this unit fed `<|turn_eos|>` and was forced to listen
    done = [e for e in events if isinstance(e, UnitDone)][-1]
    assert done.is_listen and done.fence.epoch == 1 and not done.aborted
    assert engine.session("s0").owed_len == before + 13 + 1
    assert engine.session("s0").turn.current_turn_ended


def test_override_and_update_apply_from_next_unit() -> None:
    engine, events = opened(n=1, rules=DecodeRules(force_listen_count=0))
    engine.append("s0", Fence(1, 0, seq=0), unit_pcm(0, 0), force_listen_override=True)
    engine.run_until_idle()
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == [engine.ids.listen]
    consumed = engine.session("s0").stream.consumed
    assert consumed == 0  # forced: no draw
    greedy = dataclasses.replace(params(0), greedy=True)
    engine.update("s0", Fence(1, 0), params=greedy, prompt="Be brief.")
    assert engine.session("s0").params != greedy
    engine.append("s0", Fence(1, 0, seq=1), unit_pcm(0, 1))
    engine.run_until_idle()
    s = engine.session("s0")
    assert s.params == greedy and s.stream.consumed == 0 and s.prompt == "Be brief."
    assert len(s.ledger) == 1 and s.prefix_len == len(engine.tokenizer.encode(
        "<|im_start|>system\nBe brief.\n<|audio_start|><|audio_end|><|im_end|>"))


def test_frames_add_blocks_to_the_unit() -> None:
    engine, events = opened(n=1, rules=DecodeRules(force_listen_count=1))
    before = engine.session("s0").owed_len
    engine.append("s0", Fence(1, 0, seq=0), unit_pcm(0, 0), [torch.ones(64), torch.zeros(64)])
    engine.run_until_idle()
    assert engine.session("s0").owed_len == before + 13 + 2 * 66


def test_front_end_shape_error_fails_only_that_unit() -> None:
    engine, events = opened(n=2, rules=DecodeRules(force_listen_count=1))
    before = snapshot(engine, "s1")
    engine.frontend.per_unit = 9  # violates I3: exactly 10 embeddings per unit
    engine.append("s0", Fence(1, 0, seq=0), unit_pcm(0, 0))
    engine.run_until_idle()
    done = events[-1]
    assert isinstance(done, UnitDone) and done.error and "shape" in done.error and done.aborted
    s = engine.session("s0")
    assert s.owed_len == s.prefix_len and not s.ledger and s.turn.units_generated == 0
    engine.frontend.per_unit = 10
    engine.append("s0", Fence(1, 0, seq=1), unit_pcm(0, 1))
    engine.run_until_idle()
    assert engine.session("s0").owed_len == s.prefix_len + 13 and same(snapshot(engine, "s1"), before)


def test_a_first_unit_of_a_later_units_length_starts_after_unit_zeros_extra_samples() -> None:
    """The sender's unit 0 fenced off (F-4: its append lost the race with a cancel), its unit 1 of 16,000 samples is
    the session's first: it runs as unit 0 of 480 zeros and those samples, and the units after it are accepted
    (refused, it left the session refusing every unit: found by tests/e2e/test_random_client.py)."""
    outcomes = []
    for first in (unit_pcm(0, 1), torch.cat([torch.zeros(480), unit_pcm(0, 1)])):
        engine, events = opened(1, rules=DecodeRules(force_listen_count=0))
        assert engine.append("s0", Fence(1, 0, seq=1), first) == 0
        assert engine.append("s0", Fence(1, 0, seq=2), unit_pcm(0, 2)) == 1
        engine.run_until_idle()
        outcomes.append([(e.unit_index, e.token_id) if isinstance(e, TokenEvent) else (e.unit_index, e.is_listen)
                         for e in events])
    assert outcomes[0] == outcomes[1] and {u for u, _ in outcomes[0]} == {0, 1}
