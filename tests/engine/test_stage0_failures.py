"""A step that raises fails only its units, rolls their sessions back, and the engine goes on (issue 17);
the decision event and the unit outcome come from one source, also across a cancel."""

from __future__ import annotations

from typing import Any

import pytest

from engine.stage0 import DecodeRules, Fence, SessionClosedError, Stage0Engine, TokenEvent, UnitDone
from engine.stage0.runner import Row
from tests.engine.test_stage0_engine import make_engine, params
from tests.engine.test_stage0_helpers import unit_pcm


class Fault:
    """Makes the runner's forward raise whenever a row of session `sid` is in the batch (while `on`). Its slot
    is looked up each time: the engine moves sessions into lower slots when others close."""

    def __init__(self, engine: Stage0Engine, sid: str) -> None:
        self.engine, self.sid, self.on, self.raised = engine, sid, True, 0
        self._forward = engine.runner.forward
        engine.runner.forward = self  # type: ignore[method-assign]

    def __call__(self, rows: list[Row]) -> list[Any]:
        s = self.engine.sessions.get(self.sid)
        if self.on and s is not None and any(r.slot == s.slot for r in rows):
            self.raised += 1
            raise RuntimeError("injected forward failure")
        return self._forward(rows)


def _done(events: list, sid: str, index: int) -> UnitDone:
    return next(e for e in events if isinstance(e, UnitDone) and e.session_id == sid and e.unit_index == index)


def _open(engine: Stage0Engine, *sids: str) -> None:
    for i, sid in enumerate(sids):
        engine.open(sid, Fence(1, 0), params=params(10 + i))


def test_a_failing_step_fails_only_its_units_and_the_engine_goes_on() -> None:
    engine, events = make_engine(sessions=3)
    _open(engine, "a", "b")
    for sid in ("a", "b"):
        engine.append(sid, Fence(1, 0, 1), unit_pcm(1, 0))
    engine.run_until_idle()
    a = engine.session("a")
    before = (a.cached_len, len(a.ledger), a.turn.current_turn_ended, a.turn.units_generated, len(a.history))
    fault = Fault(engine, "a")  # every forward with a row of "a" raises: a deterministic failure
    for sid in ("a", "b"):
        engine.append(sid, Fence(1, 0, 2), unit_pcm(2, 1))
    engine.run_until_idle(max_steps=200)  # returns: the failure does not repeat step after step
    assert fault.raised >= 1
    failed, fine = _done(events, "a", 1), _done(events, "b", 1)
    assert failed.error is not None and failed.error_code == "internal_error" and failed.aborted
    assert fine.error is None and not fine.aborted  # shared the failing batch, ran alone, was not harmed
    a = engine.session("a")
    assert (a.cached_len, len(a.ledger), a.turn.current_turn_ended, a.turn.units_generated,
            len(a.history)) == before  # unit 1 of "a" left nothing behind
    a.check_accounting()
    fault.on = False
    engine.append("a", Fence(1, 0, 3), unit_pcm(3, 2))
    engine.run_until_idle()
    assert _done(events, "a", 2).error is None  # the session goes on


def test_a_failure_after_the_forward_rolls_back_every_unit_of_the_step() -> None:
    engine, events = make_engine(sessions=2)
    _open(engine, "a", "b")
    sample = engine.scheduler._sample
    calls = {"n": 0}

    def broken(rows: list, logits: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected sampling failure")
        sample(rows, logits)

    engine.scheduler._sample = broken  # type: ignore[method-assign]
    for sid in ("a", "b"):
        engine.append(sid, Fence(1, 0, 1), unit_pcm(4, 0))
    engine.run_until_idle()
    assert all(_done(events, sid, 0).error_code == "internal_error" for sid in ("a", "b"))
    for sid in ("a", "b"):
        s = engine.session(sid)
        assert s.cached_len == s.prefix_len and not s.ledger  # back to the prefix alone
        s.check_accounting()
        engine.append(sid, Fence(1, 0, 2), unit_pcm(4, 1))
    engine.run_until_idle()
    assert all(_done(events, sid, 1).error is None for sid in ("a", "b"))


def test_a_prefix_that_cannot_be_fed_closes_only_its_session() -> None:
    engine, events = make_engine(sessions=2)
    _open(engine, "a")
    Fault(engine, "a")
    engine.append("a", Fence(1, 0, 1), unit_pcm(5, 0))
    _open(engine, "b")
    engine.append("b", Fence(1, 0, 1), unit_pcm(5, 0))
    engine.run_until_idle()
    assert _done(events, "a", 0).error_code == "internal_error"  # its queued unit ends, typed
    with pytest.raises(SessionClosedError):
        engine.append("a", Fence(1, 0, 2), unit_pcm(5, 1))
    assert _done(events, "b", 0).error is None


def test_decision_and_forced_come_from_the_engine_also_after_a_cancel() -> None:
    engine, events = make_engine(sessions=1, rules=DecodeRules(force_listen_count=2))
    engine.open("s", Fence(1, 0), params=params(3))
    engine.append("s", Fence(1, 0, 1), unit_pcm(6, 0))
    engine.append("s", Fence(1, 0, 2), unit_pcm(6, 1))  # queued: the cancel drops it before it starts
    engine.step()  # the prefix
    engine.step()  # unit 0 starts
    engine.cancel("s", Fence(1, 0), Fence(1, 1))
    engine.run_until_idle()
    for seq, index in enumerate(range(2, 8), start=3):
        engine.append("s", Fence(1, 1, seq), unit_pcm(6, index))
        engine.run_until_idle()
    ran = [e for e in events if isinstance(e, UnitDone) and e.error is None]
    # forced = the first two units that ran: the dropped unit 1 does not count (an index-based count would)
    assert [d.unit_index for d in ran if d.forced] == [0, 2]
    for done in ran:
        decision = next(e for e in events if isinstance(e, TokenEvent) and e.decision
                        and e.unit_index == done.unit_index)
        assert decision.forced == done.forced
        assert decision.listen == done.is_listen  # a speak unit without TTS rows is still "speak"
    assert any(not d.is_listen for d in ran)  # both kinds were exercised


def test_a_new_prompt_whose_prefix_cannot_be_built_closes_only_its_session() -> None:
    engine, events = make_engine(sessions=2)
    _open(engine, "a", "b")
    engine.run_until_idle()
    build = engine.prefix.embeds

    def broken(prompt: str, ref: Any) -> Any:
        if prompt == "bad":
            raise RuntimeError("injected prefix failure")
        return build(prompt, ref)

    engine.prefix.embeds = broken  # type: ignore[method-assign]
    engine.update("a", Fence(1, 0), prompt="bad")
    for sid in ("a", "b"):
        engine.append(sid, Fence(1, 0, 1), unit_pcm(7, 0))
    engine.run_until_idle(max_steps=200)
    assert _done(events, "a", 0).error_code == "internal_error"
    assert _done(events, "b", 0).error is None
    with pytest.raises(SessionClosedError):
        engine.append("a", Fence(1, 0, 2), unit_pcm(7, 1))


def test_a_row_that_cannot_be_built_fails_only_that_unit() -> None:
    engine, events = make_engine(sessions=2, merge_unit_close=False)  # a separate close row to break
    _open(engine, "a", "b")
    embed, close_id = engine.runner.embed, engine.ids.unit_close
    broken = {"left": 1}

    def flaky(ids: list[int]) -> Any:
        if ids[-1:] == [close_id] and len(ids) == 2 and broken["left"]:  # the first unit close of the step
            broken["left"] -= 1
            raise RuntimeError("injected embedding failure")
        return embed(ids)

    engine.runner.embed = flaky  # type: ignore[method-assign]
    for sid in ("a", "b"):
        engine.append(sid, Fence(1, 0, 1), unit_pcm(8, 0))
    engine.run_until_idle()
    outcomes = sorted(_done(events, sid, 0).error_code if _done(events, sid, 0).error else "ok" for sid in "ab")
    assert outcomes == ["internal_error", "ok"]
    for sid in ("a", "b"):
        engine.session(sid).check_accounting()
        engine.append(sid, Fence(1, 0, 2), unit_pcm(8, 1))
    engine.run_until_idle()
    assert all(_done(events, sid, 1).error is None for sid in "ab")
