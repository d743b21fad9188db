"""Issue 18 point 2: a TTS turn longer than `max_turn_positions` goes on in a fresh TTS context, never wedges.

Random weights rarely end a turn, and a turn closed by an override keeps its TTS KV (model.md Q13), so the
position of an open TTS turn can reach the cap (§5.2). Refusing every later unit (the old behaviour) left the
session speaking nothing, also after a cancel; the engine now restarts the TTS context at the unit that would
pass the cap.
"""

from __future__ import annotations

from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import Fence
from tests.engine.test_tts_engine import F0, _cfg, _run, _unit
from tests.engine.test_tts_helpers import tiny_model

CAP = 128
ROWS = 5  # a unit spans at most ROWS + 1 + max_new_tokens (26) = 32 positions: the 4th would pass 128


def test_long_turn_restarts_the_tts_context_at_the_cap() -> None:
    engine = TTSEngine(tiny_model(), _cfg(max_turn_positions=CAP))
    engine.open("a", F0, seed=3)
    results = []
    for i in range(12):  # ~3 caps' worth of one turn that never ends
        engine.submit(_unit("a", i, ROWS))
        results.extend(_run(engine))
    assert [r.unit_index for r in results] == list(range(12))
    assert all(r.end_pos <= CAP for r in results), [(r.start_pos, r.end_pos) for r in results]
    restarts = [r.unit_index for r in results if r.start_pos == 0]
    assert restarts[0] == 0 and len(restarts) >= 3, restarts  # the turn start, then every cap


def test_after_a_cancel_at_the_cap_the_session_speaks_again() -> None:
    engine = TTSEngine(tiny_model(), _cfg(max_turn_positions=CAP))
    engine.open("a", F0, seed=4)
    i = 0
    while engine.sessions["a"].tts_pos + ROWS + 27 <= CAP:  # speak until the next unit would pass the cap
        engine.submit(_unit("a", i, ROWS))
        _run(engine)
        i += 1
    engine.cancel("a", F0, Fence(incarnation=1, epoch=1))
    # the override closed the model turn; the TTS kept its position (Q13); the next turn's units still run
    engine.submit(_unit("a", i, ROWS, start=True, fence=Fence(1, 1)))
    engine.submit(_unit("a", i + 1, ROWS, fence=Fence(1, 1)))
    out = _run(engine)
    assert [r.unit_index for r in out] == [i, i + 1] and out[0].start_pos == 0
