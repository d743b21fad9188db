"""Audio and event helpers for the e2e scenarios (on top of tests/gateway_ops/wire.py's raw-text client)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from tests.gateway import conformance
from tests.gateway_ops.wire import Raw, opened

RATE = 16000
CHUNK_MS = 200
PCM16_MAX = 32767
UNIT0_MS, UNIT_MS = 1030, 1000  # model units (spec/model.md): the first is 1030 ms, then 1000 ms
PACE = 1.0  # seconds slept per second of audio sent: 1.0 = real time
CLEANUP_WAIT_S = 5.0
WAIT_S = 20.0  # one model unit through the real pipeline on 2 shared CPU cores can take seconds


def silence(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, np.float32)


def fit_units(x: np.ndarray, units: int) -> np.ndarray:
    """Pad (with silence) or cut `x` to exactly `units` model units, so no residual waits for a commit."""
    n = RATE * (UNIT0_MS + (units - 1) * UNIT_MS) // 1000
    return np.concatenate([x, np.zeros(max(0, n - len(x)), np.float32)])[:n]


def pcm16(x: np.ndarray) -> str:
    return base64.b64encode((np.clip(x, -1, 1) * PCM16_MAX).astype("<i2").tobytes()).decode()


async def send_audio(c: Raw, x: np.ndarray, pace: float = PACE, chunk_ms: int = CHUNK_MS, **extra: Any) -> None:
    """Stream `x` (16 kHz float) as `chunk_ms` pcm16 appends, sleeping `pace` x the audio duration between them."""
    step = RATE * chunk_ms // 1000
    for i in range(0, len(x), step):
        part = x[i:i + step]
        await c.send({"type": "input_audio_buffer.append", "audio": pcm16(part), "sample_rate_hz": RATE, **extra})
        if pace:
            await asyncio.sleep(pace * len(part) / RATE)


async def collect_until(c: Raw, pred: Any, wait_s: float = WAIT_S) -> dict[str, Any]:
    """Receive until `pred(event)` holds; returns that event (everything is recorded in `c.events`).

    Times out with TimeoutError whose message lists what did arrive (the stream is the diagnosis).
    """
    try:
        async with asyncio.timeout(wait_s):
            while True:
                ev = await c.recv(wait_s)
                if pred(ev):
                    return ev
    except TimeoutError:
        raise TimeoutError(f"no matching event within {wait_s}s; got: {_summary(c.events)}") from None


def _summary(events: list[dict[str, Any]]) -> str:
    out = []
    for e in events[-40:]:
        extra = e.get("error", {}).get("message") if e["type"] == "error" else e.get("model_unit_index", "")
        out.append(f"{e['type']}{'(' + str(extra) + ')' if extra not in (None, '') else ''}")
    return ", ".join(out)


async def drain(c: Raw, seconds: float = 0.5) -> None:
    with contextlib.suppress(TimeoutError):
        while True:
            await c.recv(seconds)


async def close_session(c: Raw, wait_s: float = WAIT_S) -> list[dict[str, Any]]:
    """`session.close` and read through `session.closed` (an in-flight response reaches response.done first)."""
    await c.send({"type": "session.close"})
    async with asyncio.timeout(wait_s):  # a streaming response would keep a per-event timeout from ever firing
        await c.until("session.closed", wait_s)
    await c.ws.close()
    return c.events


def assert_conformant(events: list[dict[str, Any]], profile: str = "ga") -> None:
    errs = conformance.check(events, profile)
    assert not errs, "\n".join(errs) + "\n--- stream ---\n" + "\n".join(e["type"] for e in events)


def unit_of(ev: dict[str, Any]) -> int | None:
    """The model unit an event belongs to: its own `model_unit_index` (listens) or its metadata's (deltas)."""
    return ev.get("model_unit_index", (ev.get("metadata") or {}).get("model_unit_index"))


def unit_decided(ev: dict[str, Any], unit: int) -> bool:
    """The model's decision for `unit` arrived: a listen, or the audio/text delta of a speaking unit."""
    if ev["type"] == "response.listen":
        return ev.get("model_unit_index") == unit
    if ev["type"] in ("response.output_audio.delta", "response.output_text.delta"):
        return (ev.get("metadata") or {}).get("model_unit_index") == unit
    return False


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


@contextlib.asynccontextmanager
async def cleanup(c: Raw) -> AsyncIterator[Raw]:
    """Whatever the test did, end the session (a dropped socket would hold its slot for the grace period)."""
    try:
        yield c
    finally:
        with contextlib.suppress(Exception):
            if c.ws.state.name == "OPEN":
                await c.send({"type": "session.close"})
                async with asyncio.timeout(CLEANUP_WAIT_S):
                    await c.until("session.closed", CLEANUP_WAIT_S)
        await c.ws.close()


async def response_after_unit0(addr: str, audio: np.ndarray, seed: int, response: dict[str, Any], last_unit: int,
                               session: dict[str, Any] | None = None,
                               wait_s: float = WAIT_S) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A session with `seed`, no turn detection and auto_response off (+ the `session` fields): unit 0 of `audio`
    streamed and decided (it listens: no response yet), a commit, `response.create` with `response`, the rest of
    `audio` at once, read until the model decided `last_unit`, closed. Returns `session.updated` and every event."""
    first = len(fit_units(audio, 1))
    c, _ = await opened(addr)
    async with cleanup(c):
        await c.send({"type": "session.update", "session": {
            "turn_detection": None, **(session or {}), "extra_body": {"auto_response": False, "seed": seed}}})
        updated = await c.until("session.updated", WAIT_S)
        await send_audio(c, audio[:first], pace=0)
        await collect_until(c, lambda e: unit_decided(e, 0))
        await c.send({"type": "input_audio_buffer.commit"})
        await collect_until(c, lambda e: e["type"] == "conversation.item.done")
        await c.send({"type": "response.create", "response": response})
        await collect_until(c, lambda e: e["type"] == "response.created")
        await send_audio(c, audio[first:], pace=0)
        await collect_until(c, lambda e: unit_decided(e, last_unit), wait_s=wait_s)
        return updated, await close_session(c)
