"""P13 (issue 14): how long generated text waits before its delta is handed to the socket.

The writer observes, per item carrying text, `clock at hand-over - OutItem.text_at`; the response track sets
`text_at` from the unit's first `TextPiece` (the engine's sampling stamp when it is on this clock, else the gateway's
receipt). Through a real WebSocket and the fake runtime, whose units hold their text until their audio is done
(C-3), the gateway's `/metrics` histogram counts every transcript / text delta sent, with the wait it really had.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.protocol.profiles import Profile, Projector
from gateway.resume.journal import Journal, JournalConfig, Sequencer
from gateway.runtime.base import RuntimeEvent, SessionKey, TextPiece, UnitDone, text_started_at
from gateway.session.outbox import Kind, Outbox, OutboxLimits, OutItem
from gateway.ws.writer import Writer
from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import connect, serve
from tests.gateway.scenario import stream_units

FAMILY = "duplex_transcript_delay_seconds"
HOLD_S = 0.3  # the fake's stand-in for TTS + Token2Wav: a unit's audio (and, on /v1/duplex, its text) waits this long
ENGINE_LEAD_S = 0.2  # how long before the gateway's receipt the stamped engine sampled the token


class _Sock:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_text(self, data: str) -> None:
        self.sent.append(json.loads(data))

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        return None


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _writer(clock: _Clock, seen: list[tuple[float, bool, bool]], **kw: Any) -> tuple[Writer, Outbox]:
    outbox = Outbox(OutboxLimits(1 << 20, 100, 1024, 4))
    w = Writer(outbox, Projector(Profile.GA), Sequencer(Journal(JournalConfig(60.0, 1 << 20)), lambda last: "{}"),
               on_text_sent=lambda s, audio, sampled: seen.append((s, audio, sampled)), clock=clock, **kw)
    return w, outbox


PAIR = ({"type": "response.output_audio.delta", "response_id": "r", "delta": ""},
        {"type": "response.output_audio_transcript.delta", "response_id": "r", "delta": "hi"})
TEXT = ({"type": "response.output_text.delta", "response_id": "r", "delta": "hi"},)


async def test_the_writer_reports_each_sent_text_item_once_with_its_wait() -> None:
    clock, seen = _Clock(100.0), []
    w, outbox = _writer(clock, seen)
    w.attach(_Sock(), 1)
    outbox.put(OutItem(events=({"type": "x.other"},)))  # no text: nothing to report
    outbox.put(OutItem(events=PAIR, kind=Kind.STREAM, epoch=0, response_id="r", text="hi", text_at=99.25,
                       text_sampled=True))
    outbox.put(OutItem(events=TEXT, kind=Kind.STREAM, epoch=0, response_id="r", text="hi", text_at=99.5))
    outbox.put(OutItem(events=PAIR, kind=Kind.STREAM, epoch=0, response_id="r"))  # a pair without text
    outbox.put(OutItem(events=({"type": "x.last"},), close=(1000, "done")))
    await asyncio.wait_for(w.run(), 1)
    assert seen == [(0.75, True, True), (0.5, False, False)]


async def test_text_dropped_stale_or_sent_to_nobody_is_not_reported() -> None:
    clock, seen = _Clock(10.0), []
    w, outbox = _writer(clock, seen, is_stale=lambda it: it.epoch == 0)
    outbox.put(OutItem(events=PAIR, kind=Kind.STREAM, epoch=0, response_id="r", text="hi", text_at=9.0))
    outbox.put(OutItem(events=PAIR, kind=Kind.STREAM, epoch=1, response_id="r", text="hi", text_at=9.0))
    outbox.put(OutItem(events=({"type": "x.last"},), close=(1000, "done")))
    await asyncio.wait_for(w.run(), 1)  # detached: the second pair is journaled, but no client saw it
    assert seen == []


def test_the_engine_stamp_starts_the_wait_only_when_it_is_on_this_clock() -> None:
    now = time.monotonic()
    piece = TextPiece(epoch=0, unit=1, text="a", sampled_at=now - 0.02, received_at=now)
    assert text_started_at(piece, now + 5) == (now - 0.02, True)
    # another host's CLOCK_MONOTONIC: far behind, or ahead of, the receipt -> the receipt
    assert text_started_at(TextPiece(epoch=0, unit=1, text="a", sampled_at=now - 1e6, received_at=now), now) \
        == (now, False)
    assert text_started_at(TextPiece(epoch=0, unit=1, text="a", sampled_at=now + 1, received_at=now), now) \
        == (now, False)
    assert text_started_at(TextPiece(epoch=0, unit=1, text="a"), now) == (now, False)  # unstamped: the session's


class HeldRuntime(FakeRuntime):
    """The fake with a unit's audio `HOLD_S` behind its text, and text stamped as the Triton client stamps it."""

    def __init__(self, engine_stamp: bool) -> None:
        super().__init__()
        self.engine_stamp = engine_stamp

    async def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        async for ev in super().events(key):
            if isinstance(ev, TextPiece):
                now = time.monotonic()
                ev = TextPiece(epoch=ev.epoch, unit=ev.unit, text=ev.text, token_id=ev.token_id, received_at=now,
                               sampled_at=now - ENGINE_LEAD_S if self.engine_stamp else None)
            elif isinstance(ev, UnitDone) and not ev.is_listen:
                await asyncio.sleep(HOLD_S)
            yield ev


def _histogram(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """{(response, start): {"count", "sum", "le=<edge>"...}} of the P13 family."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != FAMILY:
            continue
        for s in fam.samples:
            row = out.setdefault((s.labels["response"], s.labels["start"]), {})
            key = f"le={s.labels['le']}" if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
            row[key] = s.value
    return out


async def _run(path: str, update: dict[str, Any], engine_stamp: bool) -> tuple[list[dict[str, Any]], str]:
    rt = HeldRuntime(engine_stamp)
    rt.plan[1] = Speak("Sure, one ", 1000)
    rt.plan[2] = Speak("plus one is two.", 840, end_of_turn=True)
    async with serve(rt) as addr:
        async with connect(addr, path) as c:
            await c.send({"type": "session.update", "session": update})
            await stream_units(c, 3)
            got = await c.until("response.done")
        async with httpx.AsyncClient(base_url=f"http://{addr}") as h:
            metrics = (await h.get("/metrics")).text
    return got, metrics


async def test_realtime_transcript_deltas_leave_as_generated_not_after_their_audio() -> None:
    """P13 on /v1/realtime: each text piece is its own transcript delta, sent without waiting for the audio."""
    got, metrics = await _run("/v1/realtime", {}, engine_stamp=False)
    deltas = [e for e in got if e["type"] == "response.output_audio_transcript.delta" and e["delta"]]
    assert len(deltas) == 6  # 3 pieces per unit in the fake
    h = _histogram(metrics)
    row = h[("audio", "received")]
    assert row["count"] == 6
    assert row["le=0.1"] == 6 and row["sum"] < HOLD_S  # none waited for its unit's audio (HOLD_S)
    assert h[("text", "received")]["count"] == 0 and h[("audio", "sampled")]["count"] == 0


async def test_native_pairs_count_from_the_engine_stamp() -> None:
    got, metrics = await _run("/v1/duplex", {}, engine_stamp=True)
    pairs = [e for e in got if e["type"] == "response.output_audio.delta" and e.get("audio_transcript")]
    assert len(pairs) == 2
    h = _histogram(metrics)
    row = h[("audio", "sampled")]
    assert row["count"] == 2 and h[("audio", "received")]["count"] == 0
    assert (HOLD_S + ENGINE_LEAD_S) * 2 <= row["sum"] < (HOLD_S + ENGINE_LEAD_S + 0.15) * 2


async def test_text_only_deltas_are_counted_apart() -> None:
    got, metrics = await _run("/v1/realtime", {"output_modalities": ["text"]}, engine_stamp=False)
    assert sum(1 for e in got if e["type"] == "response.output_text.delta") == 6
    h = _histogram(metrics)
    assert h[("text", "received")]["count"] == 6 and h[("audio", "received")]["count"] == 0
    assert h[("text", "received")]["sum"] < HOLD_S  # each piece as it came, not at its unit's end
