"""Decoded tokens first (`Stage0Config.prefill_hold_ms`): while a session has tokens to feed, another session's
new unit waits (at most the hold) and the steps carry token rows only; the sessions' ids do not change."""

from __future__ import annotations

import time

import pytest

from engine.stage0 import DecodeRules, Fence, Stage0Config, Stage0Engine, TokenEvent, UnitDone
from engine.stage0.loop import TOKEN_PHASES
from engine.stage0.session import Phase, Session
from tests.engine.test_stage0_engine import by_session, make_engine, params
from tests.engine.test_stage0_helpers import tiny_llm, unit_pcm

RULES = DecodeRules(force_listen_count=0)
SPEAKER_UNITS = 6  # s1's units: with params(1) on the tiny model several of them speak


def _ids(events: list, sid: str) -> list:
    return [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator)
            for e in by_session(events, sid)]


def _s1_speaking(engine: Stage0Engine) -> tuple[Session, Session]:
    """s1 and s2 open and idle, s1 given its units and stepped until it has a decoded token to feed."""
    for sid, seed in (("s1", 1), ("s2", 2)):
        engine.open(sid, Fence(1, 0), params=params(seed))
    engine.run_until_idle()
    for k in range(SPEAKER_UNITS):
        engine.append("s1", Fence(1, 0, seq=k), unit_pcm(1, k))
    s1, s2 = engine.session("s1"), engine.session("s2")
    for _ in range(2000):
        if s1.phase is Phase.FEED:
            return s1, s2
        assert engine.step(), "s1 never had a token to feed"
    raise AssertionError("s1 never had a token to feed")


def _run(hold_ms: int, model: object) -> tuple[list, int, list[tuple[bool, int]]]:
    """s1 gets its units; once it has a token to feed, s2 appends one unit. Returns the events, s2's cached
    length at the append and, for each step after it, (s1 fed a token row, s2's cached length after it)."""
    engine, events = make_engine(model, sessions=2, rules=RULES, prefill_hold_ms=hold_ms)
    s1, s2 = _s1_speaking(engine)
    before = s2.cached_len
    engine.append("s2", Fence(1, 0, seq=0), unit_pcm(2, 0))
    trace = []
    while not any(isinstance(e, UnitDone) and e.session_id == "s2" for e in events):
        token_row = s1.phase in TOKEN_PHASES
        assert engine.step()
        trace.append((token_row, s2.cached_len))
    engine.run_until_idle()
    return events, before, trace


def test_a_new_unit_waits_while_another_session_feeds_tokens_and_ids_do_not_change() -> None:
    model = tiny_llm()
    held_events, before, held = _run(60_000, model)
    free_events, free_before, free = _run(0, model)
    assert free_before == before and free[0][0] and free[0][1] > before  # off: prefilled beside s1's token
    waited = next(i for i, (_, s2_len) in enumerate(held) if s2_len > before)
    assert waited > 0 and all(token_row for token_row, _ in held[:waited])  # it waited out s1's token rows
    assert not held[waited][0]  # and went in the first step without one
    for sid in ("s1", "s2"):
        assert _ids(held_events, sid) == _ids(free_events, sid)
    assert any(isinstance(e, UnitDone) and e.session_id == "s1" and not e.is_listen for e in held_events)


def test_the_hold_is_bounded() -> None:
    """A unit older than the hold is prefilled even while another session feeds tokens."""
    engine, _ = make_engine(tiny_llm(), sessions=2, rules=RULES, prefill_hold_ms=5)
    s1, s2 = _s1_speaking(engine)
    before = s2.cached_len
    engine.append("s2", Fence(1, 0, seq=0), unit_pcm(2, 0))
    engine.step()  # s2's unit starts, younger than the hold: waits
    assert s2.cached_len == before and s2.phase is Phase.PREFILL
    time.sleep(0.01)
    assert s1.phase in TOKEN_PHASES  # s1 still has a token row this step
    engine.step()
    assert s2.cached_len > before


def test_units_held_together_go_together_once_the_oldest_is_due() -> None:
    """Three sessions: s1 feeds tokens; s2's unit is older than the hold, s3's came just now. Both go in the same
    step (one prefill for both), not s2 alone with s3 trickling in after; before any is due, both wait."""
    engine, _ = make_engine(tiny_llm(), sessions=3, rules=RULES, prefill_hold_ms=200)
    engine.open("s3", Fence(1, 0), params=params(3))
    s1, s2 = _s1_speaking(engine)
    s3 = engine.session("s3")
    before = (s2.cached_len, s3.cached_len)
    engine.append("s2", Fence(1, 0, seq=0), unit_pcm(2, 0))
    engine.append("s3", Fence(1, 0, seq=0), unit_pcm(3, 0))
    engine.step()  # both started, both younger than the hold: they wait beside s1's token row
    assert (s2.cached_len, s3.cached_len) == before and s2.phase is s3.phase is Phase.PREFILL
    assert s1.phase in TOKEN_PHASES  # its next token (seeded: this speak unit has several), so the hold applies
    assert s2.unit is not None
    s2.unit.job.enqueued_at -= 1.0  # s2's unit is due, s3's is not
    engine.step()
    assert s2.cached_len > before[0] and s3.cached_len > before[1]


def test_prefill_hold_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prefill_hold_ms"):
        Stage0Config(prefill_hold_ms=-1)
