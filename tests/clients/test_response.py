"""`ResponseHandle` fed with fabricated events (no server): audio iteration, playback position, acks."""

import asyncio
import base64

import numpy as np

from clients.events import AudioDelta, ResponseDone, parse_event
from clients.response import ResponseHandle


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _delta(ms: int) -> AudioDelta:
    pcm = np.full(24 * ms, 7, "<i2").tobytes()
    ev = parse_event({"type": "response.output_audio.delta", "response_id": "r", "sample_rate_hz": 24000,
                      "delta": base64.b64encode(pcm).decode()})
    assert isinstance(ev, AudioDelta)
    return ev


def _handle(sent: list[dict], clock: Clock) -> ResponseHandle:
    created = parse_event({"type": "response.created", "response": {"id": "r", "duplex": {}}})

    async def send(frame: dict) -> None:
        sent.append(frame)

    return ResponseHandle(created, clock(), send, clock)  # type: ignore[arg-type]


async def test_audio_iterators_see_every_chunk_and_end_at_done() -> None:
    clock, sent = Clock(), []
    h = _handle(sent, clock)

    async def collect() -> list[bytes]:
        return [c async for c in h.audio()]

    first, second = asyncio.create_task(collect()), asyncio.create_task(collect())
    await asyncio.sleep(0)
    h._on_audio(_delta(1000), clock.t)
    h._on_text("Hello ")
    await asyncio.sleep(0)
    h._on_audio(_delta(500), clock.t + 0.2)
    done = parse_event({"type": "response.done", "response": {"id": "r", "status": "completed", "output": []}})
    assert isinstance(done, ResponseDone)
    h._on_done(done, clock.t + 0.3)
    a, b = await first, await second
    assert a == b and len(a) == 2 and b"".join(a) == h.pcm16()
    assert h.audio_ms == 1500.0 and h.transcript == "Hello "
    assert (await h.wait_done(1)).status == "completed"


async def test_played_position_stops_at_clear_and_ack_sends_it() -> None:
    clock, sent = Clock(), []
    h = _handle(sent, clock)
    h._on_audio(_delta(1000), 100.0)
    h._on_audio(_delta(1000), 100.5)
    clock.t = 100.7
    assert h.played_ms() == 700
    h._on_audio_end(100.9, cleared=True)
    clock.t = 105.0
    assert h.cleared and h.played_ms() == 900  # playback stopped at the clear
    assert h.drained_at() == 102.0
    await h.ack(truncate=True)
    assert sent == [{"type": "playback.ack", "response_id": "r", "played_ms": 900, "truncate": True}]
    h._on_audio(_delta(1000), 106.0)  # late audio after a clear is never played
    assert h.audio_ms == 2000.0
