"""Wire helpers for the issue-7 scenarios: a raw-text client (for byte-exact replay checks) and HTTP probes.

Every scenario takes only an address, so it runs against the in-process gateway (fake runtime) here and,
unchanged, against an already running real gateway (`DUPLEX_TEST_GATEWAY_URL`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import websockets

RECV_TIMEOUT_S = 15.0  # generous: through the real stack on 2 shared cores an open can take seconds


class Raw:
    """Keeps every received text exactly as it arrived, next to its parsed form."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.texts: list[str] = []
        self.events: list[dict[str, Any]] = []

    async def send(self, ev: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(ev))

    async def recv(self, wait_s: float = RECV_TIMEOUT_S) -> dict[str, Any]:
        text = await asyncio.wait_for(self.ws.recv(), wait_s)
        assert isinstance(text, str)
        self.texts.append(text)
        ev = json.loads(text)
        self.events.append(ev)
        return ev

    async def until(self, type_: str, wait_s: float = RECV_TIMEOUT_S) -> dict[str, Any]:
        while True:
            ev = await self.recv(wait_s)
            if ev["type"] == type_:
                return ev

    async def quiet(self, seconds: float = 0.3) -> None:
        with contextlib.suppress(TimeoutError):
            while True:
                await self.recv(seconds)

    async def closed(self, wait_s: float = RECV_TIMEOUT_S) -> tuple[int, str]:
        """Drain until the server closes; returns (code, reason)."""
        try:
            while True:
                await self.recv(wait_s)
        except websockets.ConnectionClosed as exc:
            assert exc.rcvd is not None
            return exc.rcvd.code, exc.rcvd.reason

    def by_seq(self) -> dict[int, str]:
        return {ev["server_event_seq"]: t for ev, t in zip(self.events, self.texts, strict=True)
                if "server_event_seq" in ev}

    @property
    def last_seq(self) -> int:
        return max(self.by_seq(), default=0)


@contextlib.asynccontextmanager
async def raw(addr: str, path: str = "/v1/realtime", **kw: Any) -> AsyncIterator[Raw]:
    async with websockets.connect(f"ws://{addr}{path}", max_size=None, **kw) as ws:
        yield Raw(ws)


async def opened(addr: str, path: str = "/v1/realtime", **kw: Any) -> tuple[Raw, dict[str, Any]]:
    """Connect (autostart) and read `session.created`; the caller closes `c.ws`."""
    ws = await websockets.connect(f"ws://{addr}{path}", max_size=None, **kw)
    c = Raw(ws)
    try:
        created = await c.recv()
        assert created["type"] == "session.created", created
    except BaseException:
        await ws.close()  # a failed open must not hold a session slot for the tests after it
        raise
    return c, created


async def resume(addr: str, session_id: str, token: str, cursor: int) -> tuple[Raw, dict[str, Any]]:
    """Open `?resume=1`, send `session.resume`; returns the client and its first event."""
    ws = await websockets.connect(f"ws://{addr}/v1/realtime?resume=1", max_size=None)
    c = Raw(ws)
    await c.send({"type": "session.resume", "session_id": session_id, "resume_token": token,
                  "last_received_server_event_seq": cursor})
    return c, await c.recv()


async def http_get(addr: str, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://{addr}", timeout=RECV_TIMEOUT_S) as h:
        return await h.get(path, **kw)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent); label order does not matter."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if metric_name == name and got == labels:
            return float(value)
    return 0.0


async def eventually(probe: Any, wait_s: float = RECV_TIMEOUT_S, every_s: float = 0.05) -> Any:
    """Poll an async probe until it returns a truthy value."""
    async with asyncio.timeout(wait_s):
        while not (got := await probe()):  # noqa: ASYNC110 - a remote condition has no event to wait on
            await asyncio.sleep(every_s)
    return got
