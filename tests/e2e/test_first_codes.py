"""A turn's first codes sent early (TTS `first_codes`, Token2Wav's head / rest parts) through the real stack: tiny
checkpoint on CPU, real tritonserver and gateway, real WebSockets (profile tests/e2e/profiles/scripted-first-codes.yaml).

The turn's first unit then reaches the client as the head's audio (a first call of 3 silence + 8 codes: 16 mel
frames, 7680 samples at 24 kHz) followed by the rest's, and still holds one second of audio; sent whole, its first
delta is the whole second (one call of 3 + 25 codes). One-stream clients of the `duplex` BLS model get the same.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, UNIT_SAMPLES
from tests.e2e.stack import REPO_ROOT, Stack
from tests.e2e.wire import (
    assert_conformant,
    cleanup,
    close_session,
    collect_until,
    fit_units,
    send_audio,
    silence,
)
from tests.gateway_ops.wire import opened
from tests.triton.talk import run_session

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STACK_PROFILE = REPO_ROOT / "tests" / "e2e" / "profiles" / "scripted-first-codes.yaml"  # conftest's `stack`
UNITS = 6  # 3 forced listens, a listen, then a turn of 2 speaking units (units 4 and 5)
OUT_RATE = 24000
HEAD_SAMPLES = 2 * 8 * 480  # 8 codes past the 3 silence codes: 2 mel frames per code, 480 samples per frame


def _samples(ev: dict[str, Any]) -> int:
    return len(base64.b64decode(ev["delta"])) // 2


async def speak_one_turn(addr: str, units: int) -> tuple[dict[str, Any], list[dict[str, Any]], dict[int, list[int]]]:
    """`units` units of silence at once; the first response.done, every event, and each unit's delta sizes."""
    c, _ = await opened(addr)
    async with cleanup(c):
        await send_audio(c, fit_units(silence(0), units), pace=0)
        done = await collect_until(c, lambda e: e["type"] == "response.done", wait_s=120)
        events = await close_session(c)
    assert done["response"]["status"] == "completed", done
    deltas: dict[int, list[int]] = {}
    for e in events:
        if e["type"] == "response.output_audio.delta":
            deltas.setdefault(e["metadata"]["model_unit_index"], []).append(_samples(e))
    return done, events, deltas


async def test_a_turns_first_unit_arrives_head_first_and_whole(stack: Stack) -> None:
    _, events, deltas = await speak_one_turn(stack.addr, UNITS)
    first, *later = sorted(deltas)
    assert later, deltas  # the turn's second unit spoke too
    head, *rest = deltas[first]
    assert head == HEAD_SAMPLES and rest, deltas[first]  # the head's call alone, then the rest's audio
    assert sum(deltas[first]) == OUT_RATE, deltas[first]  # one second, as a unit sent whole
    assert not any(e["type"] == "error" for e in events), [e for e in events if e["type"] == "error"]
    assert_conformant(events)


def test_the_duplex_pipeline_chains_the_two_parts_too(stack: Stack) -> None:
    """One-stream clients (the `duplex` BLS model, docs/triton.md) get the same: the turn's first speaking unit
    answers with the head's audio first and one second of audio in all."""
    pcm = np.zeros(FIRST_UNIT_SAMPLES + (UNITS - 1) * UNIT_SAMPLES, np.float32)
    run = run_session(f"127.0.0.1:{stack.triton_ports[1]}", pcm, seed=0, timeout_s=120.0)
    spoken = [(d, u) for d, u in zip(run.decisions(), run.units, strict=True) if d == "speak"]
    assert len(spoken) >= 2, run.decisions()
    first = [a.size for a in spoken[0][1].audio if a.size]
    assert first[0] == HEAD_SAMPLES and len(first) > 1 and sum(first) == OUT_RATE, first
    assert not any(u.of_type("error") for u in run.units), [u.of_type("error") for u in run.units]
