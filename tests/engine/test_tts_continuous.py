"""Stage1 `continuous`: units join and leave the TTS batch between single-code steps, with the same codes,
draws and positions as units run whole (CPU, tiny checkpoint; the CUDA-graph lanes are in test_tts_graph.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import Fence, TTSHeadCodes, TTSUnitRequest, TTSUnitResult
from tests.engine.test_tts_engine import F0, _cfg, _run, _unit
from tests.engine.test_tts_first_codes import Recorder
from tests.engine.test_tts_helpers import tiny_model, with_eos_bias

STEPS = 26  # samples per unit: one prefill, then 25 single-code steps


def _script(sessions: int) -> list[list[TTSUnitRequest]]:
    """Per session, its units in order: turns of different lengths, row counts and turn ends."""
    return [[_unit(f"s{s}", u, (3 * s + u) % 7, end=(u + s) % 3 == 2, start=u == 0, seed=s) for u in range(4)]
            for s in range(sessions)]


def _whole(model: torch.nn.Module, script: list[list[TTSUnitRequest]]) -> list[TTSUnitResult]:
    """Each session alone, its units one after another, each unit run whole."""
    out: list[TTSUnitResult] = []
    for s, units in enumerate(script):
        engine = TTSEngine(model, _cfg(max_batch=1))
        engine.open(f"s{s}", F0, seed=100 + s)
        for req in units:
            engine.submit(req)
            out += _run(engine)
    return sorted(out, key=lambda r: (r.session_id, r.unit_index))


def _staggered(model: torch.nn.Module, script: list[list[TTSUnitRequest]], max_batch: int,
               rec: Recorder | None = None) -> tuple[list[TTSUnitResult], list[int]]:
    """Continuous: session s submits unit u at step 7 * s + 11 * u, so units join while others are part way
    through theirs (and queue behind their own session's unit in flight). Returns results and rows per step."""
    engine = TTSEngine(model, _cfg(max_batch=max_batch, continuous=True))
    for s in range(len(script)):
        engine.open(f"s{s}", F0, seed=100 + s)
    arrivals = sorted((7 * s + 11 * u, s, u) for s, units in enumerate(script) for u in range(len(units)))
    out: list[TTSUnitResult] = []
    rows: list[int] = []
    step = 0
    while arrivals or engine.pending():
        while arrivals and arrivals[0][0] <= step:
            _, s, u = arrivals.pop(0)
            engine.submit(script[s][u])
        out += engine.step(on_head=rec.on_head if rec else None)
        rows.append(engine.rows_last_step)
        step += 1
    return sorted(out, key=lambda r: (r.session_id, r.unit_index)), rows


def test_units_joining_between_steps_get_the_codes_of_whole_units() -> None:
    model = with_eos_bias(tiny_model(), 6.0)  # EOS sometimes: rows leave at different steps
    script = _script(6)
    want = _whole(model, script)
    got, rows = _staggered(model, script, max_batch=8)
    assert got == want
    assert {len(r.codes) for r in want} > {25}  # early-EOS units and full units
    assert max(rows) > 1 and len(set(rows)) > 2  # the batch grew and shrank between steps
    few, few_rows = _staggered(model, script, max_batch=2)  # lanes full: units wait for a free lane
    assert few == want and max(few_rows) == 2


def test_a_unit_joins_the_next_step_and_leaves_after_its_own_samples() -> None:
    engine = TTSEngine(tiny_model(), _cfg(continuous=True))
    for sid in ("a", "b"):
        engine.open(sid, F0, seed=1)
    engine.submit(_unit("a", 0, 3))  # mid-turn units: EOS masked, all 26 samples drawn
    done: dict[str, int] = {}
    for step in range(1, 40):
        if step == 6:
            engine.submit(_unit("b", 0, 2))
        for r in engine.step():
            done[r.session_id] = step
        if step == 6:
            assert engine.rows_last_step == 2  # b prefilled and stepped beside a, which is part way
    assert done == {"a": STEPS - 1, "b": 6 + STEPS - 2}  # prefill + first step in one call, then one a call
    assert engine.pending() == 0


@pytest.mark.parametrize("k", [1, 3])
def test_heads_leave_before_their_unit_and_equal_its_first_codes(k: int) -> None:
    model = tiny_model()
    script = [[_unit(f"s{s}", 0, 2 + s, start=True, seed=s), _unit(f"s{s}", 1, 3, seed=s)] for s in range(4)]
    want = _whole(model, script)
    rec = Recorder()
    got = _all_queued(model, script, rec, first_codes=k)
    assert [dataclasses.replace(r, head=0) for r in got] == want
    heads = rec.heads()
    assert set(heads) == {(f"s{s}", 0) for s in range(4)}  # the turn-start units only
    for r in got:
        assert r.head == (k if r.unit_index == 0 else 0)
        if r.head:
            assert heads[(r.session_id, 0)] == TTSHeadCodes(r.session_id, F0, 0, r.codes[:k], 25)
    order = [(kind, (x.session_id, x.unit_index)) for kind, x in rec.log]
    for s in range(4):
        assert order.index(("head", (f"s{s}", 0))) < order.index(("result", (f"s{s}", 0)))


def test_heads_of_every_unit_leave_before_their_units_in_continuous_steps() -> None:
    model = tiny_model()
    script = [[_unit(f"s{s}", 0, 2 + s, start=True, seed=s), _unit(f"s{s}", 1, 3, seed=s)] for s in range(4)]
    want = _whole(model, script)
    rec = Recorder()
    got = _all_queued(model, script, rec, first_codes=3, head_every_unit=True)
    assert [dataclasses.replace(r, head=0) for r in got] == want and all(r.head == 3 for r in got)
    heads = rec.heads()
    assert set(heads) == {(f"s{s}", u) for s in range(4) for u in (0, 1)}  # mid-turn units too
    order = [(kind, (x.session_id, x.unit_index)) for kind, x in rec.log]
    for r in got:
        key = (r.session_id, r.unit_index)
        assert heads[key].codes == r.codes[:3] and order.index(("head", key)) < order.index(("result", key))


def _all_queued(model: torch.nn.Module, script: list[list[TTSUnitRequest]], rec: Recorder,
                **cfg: object) -> list[TTSUnitResult]:
    engine = TTSEngine(model, _cfg(continuous=True, **cfg))
    for s in range(len(script)):
        engine.open(f"s{s}", F0, seed=100 + s)
    out: list[TTSUnitResult] = []
    for units in script:  # all units queued at once: each session's second waits for its first
        for req in units:
            engine.submit(req)
    while engine.pending():
        results = engine.step(on_head=rec.on_head)
        rec.log.extend(("result", r) for r in results)
        out += results
    return sorted(out, key=lambda r: (r.session_id, r.unit_index))


def test_closing_a_session_mid_unit_frees_its_lane_and_slot_cleanly() -> None:
    """A closed session's unit leaves its lane at once: the session that gets its KV slot next, and the one
    beside it in the batch, get the codes they get alone."""
    model = tiny_model()
    engine = TTSEngine(model, _cfg(max_sessions=2, continuous=True))
    engine.open("a", F0, seed=1)
    engine.open("b", F0, seed=2)
    engine.submit(_unit("a", 0, 3, seed=1))
    engine.submit(_unit("b", 0, 4, seed=2))
    for _ in range(10):
        assert engine.step() == []
    assert engine.close("a", F0) and engine.slots.free == 1
    engine.open("c", F0, seed=3)  # a's slot, while b is still in flight
    engine.submit(_unit("c", 0, 5, seed=3))
    got = {r.session_id: r for r in _run(engine)}
    assert set(got) == {"b", "c"} and engine.pending() == 0

    def alone(sid: str, seed: int, req: TTSUnitRequest) -> TTSUnitResult:
        solo = TTSEngine(model, _cfg())
        solo.open(sid, F0, seed=seed)
        solo.submit(req)
        (r,) = _run(solo)
        return r

    assert got["b"] == alone("b", 2, _unit("b", 0, 4, seed=2))
    assert got["c"] == alone("c", 3, _unit("c", 0, 5, seed=3))


def test_a_cancel_mid_unit_drops_its_result_and_keeps_the_turn_state_of_whole_units() -> None:
    """The unit in flight finishes in its lane (the TTS turn state stays as the reference leaves it, Q13) but
    its result is not handed out; the session's next unit and the other session are as with whole units."""
    model = tiny_model()
    ref, eng = TTSEngine(model, _cfg()), TTSEngine(model, _cfg(continuous=True))
    for e in (ref, eng):
        e.open("a", F0, seed=1)
        e.open("b", F0, seed=2)
        e.submit(_unit("a", 0, 3, start=True))
        e.submit(_unit("b", 0, 2))
    want = {r.session_id: r for r in _run(ref)}
    f1 = Fence(1, 1)
    ref.cancel("a", F0, f1)
    for _ in range(5):
        eng.step()
    assert not eng.cancel("a", F0, f1).noop
    got = _run(eng)
    assert got == [want["b"]] and eng.pending() == 0
    assert eng.sessions["a"].tts_pos == ref.sessions["a"].tts_pos > 0
    for e in (ref, eng):
        e.submit(_unit("a", 1, 4, fence=f1))
    assert _run(eng) == _run(ref)
