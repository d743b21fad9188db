"""Every unit's first codes sent early (TTS `head_every_unit`) through the real stack: tiny checkpoint on CPU, real
tritonserver and gateway, real WebSockets (profile tests/e2e/profiles/scripted-head-every-unit.yaml).

Each speaking unit then reaches the client as its head's audio, then its rest's: the turn's first unit as in
test_first_codes.py, a mid-turn unit as one call of its 3 look-ahead codes + 8 (16 mel frames, 7680 samples) before
the rest; every unit but the turn's last still holds one second of audio. One-stream clients of the `duplex` BLS
model get the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, UNIT_SAMPLES
from tests.e2e.stack import REPO_ROOT, Stack
from tests.e2e.test_first_codes import HEAD_SAMPLES, OUT_RATE, speak_one_turn
from tests.e2e.wire import assert_conformant
from tests.triton.talk import run_session

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STACK_PROFILE = REPO_ROOT / "tests" / "e2e" / "profiles" / "scripted-head-every-unit.yaml"  # conftest's `stack`
UNITS = 7  # 3 forced listens, a listen, then a turn of 3 speaking units (units 4, 5 and 6)


def _check_turn(per_unit: list[list[int]]) -> None:
    """Every speaking unit's deltas: the head's call first, then the rest's audio; one second but the last."""
    assert len(per_unit) == 3, per_unit
    for sizes in per_unit:
        assert sizes[0] == HEAD_SAMPLES and len(sizes) > 1, per_unit
    assert [sum(s) for s in per_unit[:2]] == [OUT_RATE, OUT_RATE], per_unit


async def test_every_unit_of_a_turn_arrives_head_first(stack: Stack) -> None:
    done, events, deltas = await speak_one_turn(stack.addr, UNITS)
    _check_turn([deltas[u] for u in sorted(deltas)])
    # the stage metrics see each unit's first TTS codes (its head) before its first audio
    talker = done["response"]["duplex"]["stage_metrics"]["1"]["from_unit_ms_by_unit"]
    audio = done["response"]["duplex"]["stage_metrics"]["2"]["from_unit_ms_by_unit"]
    assert len(talker) == len(audio) == 3 and all(t <= a for t, a in zip(talker, audio, strict=True)), done
    assert not any(e["type"] == "error" for e in events), [e for e in events if e["type"] == "error"]
    assert_conformant(events)


def test_the_duplex_pipeline_chains_every_units_parts_too(stack: Stack) -> None:
    pcm = np.zeros(FIRST_UNIT_SAMPLES + (UNITS - 1) * UNIT_SAMPLES, np.float32)
    run = run_session(f"127.0.0.1:{stack.triton_ports[1]}", pcm, seed=0, timeout_s=120.0)
    spoken = [u for d, u in zip(run.decisions(), run.units, strict=True) if d == "speak"]
    _check_turn([[a.size for a in u.audio if a.size] for u in spoken])
    assert not any(u.of_type("error") for u in run.units), [u.of_type("error") for u in run.units]
