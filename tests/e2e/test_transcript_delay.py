"""P13 through the real stack: the gateway's `duplex_transcript_delay_seconds` counts every transcript / text delta
it sent, each timed from the engine's sampling of its first token (stage0 stamps `sampled_at`; gateway and Triton
share this host's CLOCK_MONOTONIC, so every observation is labelled start="sampled").

Tiny checkpoint on CPU with stage0 on the scripted plan of tests/e2e/profiles/scripted.yaml: after the 3 forced
listen units, unit 3 listens and units 4-5 speak, so 6 units of input give one response of two speaking units.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import REPO_ROOT, Stack
from tests.e2e.wire import cleanup, close_session, collect_until, fit_units, send_audio, silence, unit_decided
from tests.gateway_ops.wire import http_get, metric, opened

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROFILE = REPO_ROOT / "tests" / "e2e" / "profiles" / "scripted.yaml"
UNITS, LAST_SPEAK = 6, 5
FAMILY = "duplex_transcript_delay_seconds"
LIMIT_S = 60.0  # a wait beyond this would be a clock mix-up, not a slow CPU


@pytest.fixture(scope="module")
def scripted(e2e_cache: Path) -> Iterator[Stack]:
    s = Stack(e2e_cache, profile=PROFILE, max_sessions=2)
    s.start()
    try:
        yield s
    finally:
        s.stop_soon()


async def _counts(addr: str, response: str) -> dict[str, float]:
    text = (await http_get(addr, "/metrics")).text
    out = {start: metric(text, f"{FAMILY}_count", response=response, start=start) for start in ("sampled", "received")}
    out["sum"] = metric(text, f"{FAMILY}_sum", response=response, start="sampled")
    out["under_limit"] = metric(text, f"{FAMILY}_bucket", response=response, start="sampled", le="10.0")
    return out


async def _one_response(addr: str, update: dict[str, Any]) -> list[dict[str, Any]]:
    c, _ = await opened(addr)
    async with cleanup(c):
        await c.send({"type": "session.update", "session": update})
        await c.until("session.updated", 20)
        await send_audio(c, fit_units(silence(0), UNITS), pace=0)
        await collect_until(c, lambda e: unit_decided(e, LAST_SPEAK), wait_s=120)
        return await close_session(c)


@pytest.mark.parametrize(("response", "update", "delta_type"), [
    ("audio", {}, "response.output_audio_transcript.delta"),
    ("text", {"output_modalities": ["text"]}, "response.output_text.delta"),
])
async def test_every_delta_sent_is_counted_from_its_sampling(scripted: Stack, response: str, update: dict[str, Any],
                                                             delta_type: str) -> None:
    before = await _counts(scripted.addr, response)
    events = await _one_response(scripted.addr, update)
    after = await _counts(scripted.addr, response)
    sent = [e for e in events if e["type"] == delta_type and e["delta"]]
    assert len(sent) >= 1, [e["type"] for e in events]
    assert after["sampled"] - before["sampled"] == len(sent)
    assert after["received"] == before["received"]  # one host: the engine's stamp is on the gateway's clock
    waited = after["sum"] - before["sum"]
    assert 0 < waited < LIMIT_S * len(sent)
    assert after["under_limit"] - before["under_limit"] == len(sent)



async def test_a_units_text_reaches_the_client_before_its_audio(scripted: Stack) -> None:
    """Issue 14 "transcript deltas arrive before the unit's end", through real Triton: on /v1/realtime each speaking
    unit's first text delta comes before that unit's first audio delta, and every audio delta is still followed by
    its transcript half (C-3)."""
    events = await _one_response(scripted.addr, {})
    first_text: dict[int, int] = {}
    first_audio: dict[int, int] = {}
    for i, e in enumerate(events):
        unit = (e.get("metadata") or {}).get("model_unit_index")
        if e["type"] == "response.output_audio_transcript.delta" and e["delta"]:
            first_text.setdefault(unit, i)
        elif e["type"] == "response.output_audio.delta":
            first_audio.setdefault(unit, i)
            assert events[i + 1]["type"] == "response.output_audio_transcript.delta"
    assert first_text, [e["type"] for e in events]
    assert all(unit in first_audio and first_text[unit] < first_audio[unit] for unit in first_text), \
        (first_text, first_audio)


async def test_a_unit_of_two_vocoder_calls_reaches_the_client_as_two_audio_deltas(scripted: Stack) -> None:
    """Issue 14 "audio as each Token2Wav call finishes", through real Triton: a unit whose audio takes two Token2Wav
    calls (the turn's end flushes the mel cache in a second call) arrives as several audio deltas, and only the
    unit's last one carries its metrics (and the turn's end)."""
    c, _ = await opened(scripted.addr)
    async with cleanup(c):
        await send_audio(c, fit_units(silence(0), UNITS), pace=0)
        await collect_until(c, lambda e: e["type"] == "response.done", wait_s=120)  # the turn's end, all its audio
        events = await close_session(c)
    deltas: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e["type"] == "response.output_audio.delta":
            deltas.setdefault(e["metadata"]["model_unit_index"], []).append(e["metadata"])
    assert any(len(md) > 1 for md in deltas.values()), {u: len(md) for u, md in deltas.items()}
    for md in deltas.values():
        assert ["unit_metrics" in m for m in md] == [False] * (len(md) - 1) + [True]
        assert not any(m["end_of_turn"] for m in md[:-1])
