"""Per-unit thinker temperature (`append(temperature=...)`, the response-scoped option of protocol.md §2.8).

The reference is the session-level path: the same session with `update(params=...)` before the unit and back
after it. The override must sample exactly like that, leave the session's own params alone, and leave the
other rows of the batch untouched (their solo run).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.stage0 import BadSamplingError, Fence, SamplingParams, TokenEvent, UnitDone
from tests.engine.test_stage0_engine import by_session, make_engine
from tests.engine.test_stage0_helpers import tiny_llm, unit_pcm

UNITS = 4
HOT_UNIT = 1  # the unit that carries the override
BASE = SamplingParams(seed=7, temperature=0.3, top_k=320, top_p=1.0)
OTHER = SamplingParams(seed=8, temperature=1.5, top_k=320, top_p=1.0)
HOT = 2.0
PCM_SEED = {"a": 10, "b": 11}


def trace(events: list, sid: str) -> list[tuple]:
    """What a session produced: every token id and every unit's terminator, in order."""
    return [(type(e).__name__, e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator)
            for e in by_session(events, sid)]


def unit_trace(events: list, sid: str, unit: int) -> list[tuple]:
    return [t for t in trace(events, sid) if t[1] == unit]


def run(model, sessions: dict[str, SamplingParams], overrides: dict[tuple[str, int], float],
        session_level: dict[tuple[str, int], SamplingParams]) -> tuple[object, list]:
    """Each session appends UNITS units; all sessions' unit k are in flight together (one batch).

    `overrides[(sid, k)]` rides on append k; `session_level[(sid, k)]` is an `update` before append k."""
    engine, events = make_engine(model, sessions=len(sessions))
    for sid, p in sessions.items():
        engine.open(sid, Fence(1, 0), params=p)
    engine.run_until_idle()
    for k in range(UNITS):
        for sid in sessions:
            if (sid, k) in session_level:
                engine.update(sid, Fence(1, 0), params=session_level[(sid, k)])
            engine.append(sid, Fence(1, 0, seq=k), unit_pcm(PCM_SEED[sid], k),
                          temperature=overrides.get((sid, k)))
        engine.run_until_idle()
    return engine, events


@pytest.mark.parametrize("temperature,session_params", [
    (HOT, dataclasses.replace(BASE, temperature=HOT)),
    (0.0, dataclasses.replace(BASE, greedy=True)),  # temperature 0 is greedy, as on the CONFIG path
])
def test_unit_override_equals_session_level_and_spares_other_rows(temperature: float,
                                                                   session_params: SamplingParams) -> None:
    model = tiny_llm()
    both = {"a": BASE, "b": OTHER}
    eng, got = run(model, both, {("a", HOT_UNIT): temperature}, {})
    _, plain = run(model, both, {}, {})
    ref_eng, ref_a = run(model, {"a": BASE}, {}, {("a", HOT_UNIT): session_params, ("a", HOT_UNIT + 1): BASE})
    _, ref_b = run(model, {"b": OTHER}, {}, {})

    # the override changed what unit HOT_UNIT sampled (else this test could not tell it was applied)
    assert unit_trace(got, "a", HOT_UNIT) != unit_trace(plain, "a", HOT_UNIT)
    assert unit_trace(got, "a", 0) == unit_trace(plain, "a", 0)
    # ... exactly as the session-level temperature would, units after it included (back to the session's)
    assert trace(got, "a") == trace(ref_a, "a")
    assert eng.session("a").history == ref_eng.session("a").history
    assert eng.session("a").stream.consumed == ref_eng.session("a").stream.consumed
    assert eng.session("a").params == BASE  # the session's own params never changed
    # the other row of every batch is its solo run
    assert trace(got, "b") == trace(ref_b, "b") == trace(plain, "b")
    assert sum(1 for e in by_session(got, "a") if isinstance(e, UnitDone) and not e.is_listen) > 0


def test_bad_unit_temperature_is_refused_and_the_session_goes_on() -> None:
    engine, events = make_engine(tiny_llm())
    engine.open("a", Fence(1, 0), params=BASE)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(BadSamplingError):
            engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0), temperature=bad)
    assert engine.session("a").appended == 0 and not engine.session("a").queue
    assert engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0), temperature=0.5) == 0
    engine.run_until_idle()
    assert [e for e in events if isinstance(e, UnitDone)][-1].unit_index == 0
