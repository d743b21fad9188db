"""Shared scenario helpers for the gateway tests (real WebSocket, fake runtime)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tests.gateway import conformance
from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.harness import Client, append, connect, serve

UNIT0_MS, UNIT_MS = 1030, 1000


@contextlib.asynccontextmanager
async def _address(rt: FakeRuntime, addr: str | None, settings: dict[str, Any]) -> AsyncIterator[str]:
    if addr is not None:  # an already running gateway (e2e through real Triton): nothing to start
        yield addr
        return
    async with serve(rt, **settings) as started:
        yield started


@contextlib.asynccontextmanager
async def session(rt: FakeRuntime | None = None, path: str = "/v1/realtime", update: dict | None = None,
                  headers: dict | None = None, addr: str | None = None,
                  **settings: Any) -> AsyncIterator[tuple[Client, FakeRuntime]]:
    """A connected, opened session. With `addr`, the same scenario runs against a real gateway."""
    rt = rt or FakeRuntime()
    async with _address(rt, addr, settings) as where, connect(where, path, headers=headers) as c:
        if update is not None:
            await c.send({"type": "session.update", "session": update})
        first = await c.recv()
        assert first["type"] == "session.created", first
        if update is not None:
            upd = await c.recv()
            assert upd["type"] == "session.updated", upd
        yield c, rt


async def stream_units(c: Client, units: int, chunk_ms: int = 200, **extra: Any) -> None:
    """Send exactly enough audio to complete `units` model units (no residual)."""
    total = UNIT0_MS + (units - 1) * UNIT_MS
    sent = 0
    while sent < total:
        ms = min(chunk_ms, total - sent)
        await c.send(append(ms, **extra))
        sent += ms


async def close(c: Client) -> list[dict]:
    await c.send({"type": "session.close"})
    await c.until("session.closed")
    return c.events


def assert_conformant(events: list[dict], profile: str = "ga") -> None:
    errs = conformance.check(events, profile)
    assert not errs, "\n".join(errs) + "\n" + "\n".join(e["type"] for e in events)


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]
