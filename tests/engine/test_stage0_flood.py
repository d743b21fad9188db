"""Issue 18 point 3: audio faster than real time is refused past a queue cap, and no row is ever written past
a session's KV slot (a unit that would be fails alone, typed; the engine and other sessions go on)."""

from __future__ import annotations

import pytest

from engine.stage0 import Fence, UnitDone
from engine.stage0.types import CapacityError
from tests.engine.test_stage0_engine import make_engine, params
from tests.engine.test_stage0_helpers import unit_pcm

CAP = 6


def _run_all(engine, max_steps: int = 10_000) -> None:  # noqa: ANN001 - Stage0Engine
    """Step until no session has work left. (`run_until_idle` stops at a step whose only row failed: the
    engine thread just sleeps one idle wait then, but a test would stop with units queued.)"""
    for _ in range(max_steps):
        if not engine.step() and not any(s.queue or s.unit for s in engine.sessions.values()):
            return
    raise AssertionError("engine did not finish")


def test_units_beyond_the_queue_cap_are_refused_until_the_engine_catches_up() -> None:
    engine, events = make_engine(sessions=2, max_queued_units=CAP)
    engine.open("a", Fence(1, 0), params=params(1))
    for i in range(CAP):
        engine.append("a", Fence(1, 0, i + 1), unit_pcm(1, i))
    with pytest.raises(CapacityError, match="ahead of real time"):
        engine.append("a", Fence(1, 0, CAP + 1), unit_pcm(1, CAP))
    engine.run_until_idle()
    engine.append("a", Fence(1, 0, CAP + 1), unit_pcm(1, CAP))  # caught up: accepted again
    engine.run_until_idle()
    done = [e.unit_index for e in events if isinstance(e, UnitDone)]
    assert done == list(range(CAP + 1))


def test_a_row_past_the_kv_fails_its_unit_not_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, events = make_engine(sessions=2, window_high=64, window_low=32)
    monkeypatch.setattr(engine.scheduler, "_evict", lambda s: None)  # as if eviction had a gap: the cache keeps growing
    engine.open("a", Fence(1, 0), params=params(2))
    engine.open("b", Fence(1, 0), params=params(3))
    units = 12  # ~13+ positions each: far past a slot of 64 + one unit
    for i in range(units):
        engine.append("a", Fence(1, 0, i + 1), unit_pcm(2, i))
    engine.append("b", Fence(1, 0, 1), unit_pcm(3, 0))
    _run_all(engine)  # no IndexError out of the KV write
    a = [e for e in events if isinstance(e, UnitDone) and e.session_id == "a"]
    assert [e.unit_index for e in a] == list(range(units))  # every unit ended, none was lost
    failed = [e for e in a if e.error]
    assert failed and all("pass the KV slot" in e.error for e in failed), [e.error for e in a]
    b = [e for e in events if isinstance(e, UnitDone) and e.session_id == "b"]
    assert len(b) == 1 and not b[0].error  # the other session never noticed
    assert engine.session("a").cached_len <= engine.runner.kv.reserved_pos
