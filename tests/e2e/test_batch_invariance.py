"""A session's output does not depend on which other sessions share its engine steps (the quality bar's
determinism), through the real stack: tritonserver serving the tiny checkpoint on CPU, the gateway, WebSockets.

The watched session (its own seed, the same audio) runs once alone and once beside another session that streams
other audio with another seed at the same time, so their units share stage0, TTS and Token2Wav steps in some
order the schedule picks. Its decisions, its text and the bytes of its audio must be the same both times.
"""

from __future__ import annotations

import asyncio
import base64
import urllib.request
from typing import Any

import numpy as np
import pytest

from bench.loadgen import stages
from tests.e2e.stack import SHARED_ENV, Stack, profile_engine
from tests.e2e.wire import fit_units, response_after_unit0, unit_of

pytestmark = pytest.mark.e2e
STACK_ENV = SHARED_ENV  # the shared stack of test_response_temperature (2 sessions, force_listen_count 0)
SEED, OTHER_SEED = 5, 1234
OWNED = (1, 2, 3, 4, 5)  # the units sent after response.create
UNITS = 1 + len(OWNED) + 1  # one more: its decision comes after all of the last owned unit's output
ATTEMPTS = 8  # runs beside the other session until each stage has held both sessions' rows in one step


def extra_rows(stack: Stack) -> dict[str, float]:
    """Each stage's rows so far past one per engine step (Triton's rows-per-step histogram, sum - count): it grows
    exactly when a step holds rows of two sessions or more."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.triton_ports[2]}/metrics", timeout=5) as resp:
        sample = stages.parse(resp.read().decode())
    return {s: sample[("duplex_stage_rows_per_step_sum", s)] - sample[("duplex_stage_rows_per_step_count", s)]
            for s in stages.STAGES}


async def _session(addr: str, audio: np.ndarray, seed: int) -> dict[int, dict[str, Any]]:
    """One session's response units: {unit: {listen, text, audio bytes}}, the deltas of a unit joined (transcript
    deltas run ahead of their audio as the text is generated, so the order of the two kinds follows the schedule)."""
    _, events = await response_after_unit0(addr, audio, seed, {}, OWNED[-1] + 1, wait_s=60.0)
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        unit = unit_of(e)
        if unit not in OWNED:
            continue
        got = out.setdefault(unit, {"listen": False, "text": "", "audio": b""})
        if e["type"] == "response.output_audio.delta":
            got["audio"] += base64.b64decode(e["delta"])
        elif e["type"] == "response.output_audio_transcript.delta":
            got["text"] += e["delta"]
        elif e["type"] == "response.listen":
            got["listen"] = True
    return out


def _same(alone: dict[int, dict[str, Any]], watched: dict[int, dict[str, Any]]) -> None:
    assert any(u["audio"] for u in alone.values()), f"the watched session made no audio: nothing to compare ({alone})"
    assert sorted(watched) == sorted(alone) == list(OWNED)
    for unit in OWNED:
        a, b = alone[unit], watched[unit]
        assert (b["listen"], b["text"]) == (a["listen"], a["text"]), unit
        assert b["audio"] == a["audio"], (f"unit {unit}: audio bytes differ ({len(a['audio'])} alone, "
                                          f"{len(b['audio'])} beside)")


@pytest.mark.timeout(300)
@pytest.mark.skipif(profile_engine().endswith("loopback"), reason="the loopback stand-in does not sample")
async def test_a_sessions_text_and_audio_bytes_are_the_same_alone_and_beside_another(
        stack: Stack, addr: str, speech: np.ndarray) -> None:
    audio = fit_units(speech, UNITS)
    other = fit_units(np.roll(speech, len(speech) // 3) * 0.8, UNITS + 2)
    alone = await _session(addr, audio, SEED)
    before, shared = extra_rows(stack), set()
    for _ in range(ATTEMPTS):  # until every stage has had a step with both sessions' rows
        watched, others = await asyncio.gather(_session(addr, audio, SEED), _session(addr, other, OTHER_SEED))
        assert others, "the other session made no output"
        _same(alone, watched)
        after = extra_rows(stack)
        shared |= {s for s in stages.STAGES if after[s] > before[s]}
        if shared == set(stages.STAGES):
            break
    assert shared == set(stages.STAGES), f"only {sorted(shared)} ran a step with both sessions' rows"
