"""WebSocket plumbing for `DuplexClient`: URLs, the opening and resume handshakes, and typed failures."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import websockets

from clients.events import ErrorEvent, ServerEvent, SessionCreated, parse_event
from clients.resume import ResumeCredentials

HANDSHAKE_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the largest WebSocket message the gateway's library takes (§1.5)
INPUT_RATE = 16_000
DEFAULT_SESSION: dict[str, Any] = {
    "type": "realtime",
    "output_modalities": ["audio"],
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}, "turn_detection": None},
              "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
}


class DuplexError(Exception):
    """A handshake refusal or a failed resume; `event` is the server's error, if it sent one."""

    def __init__(self, message: str, event: ErrorEvent | None = None) -> None:
        super().__init__(message)
        self.event = event

    @property
    def code(self) -> str | None:
        return self.event.code if self.event else None


def ws_url(base_url: str, route: str, **query: str) -> str:
    """`http(s)://host:port` or `ws(s)://host:port[/prefix]` + route + query -> a ws(s) URL."""
    parts = urlsplit(base_url if "://" in base_url else f"ws://{base_url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/") + route
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


async def _first_event(ws: websockets.ClientConnection) -> ServerEvent:
    raw = json.loads(await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT_S))
    return parse_event(raw)


async def _fail(ws: websockets.ClientConnection, ev: ServerEvent, what: str) -> DuplexError:
    await ws.close()
    if isinstance(ev, ErrorEvent):
        return DuplexError(f"{what}: {ev.code}: {ev.message}", ev)
    return DuplexError(f"{what}: unexpected first event {ev.type}")


async def open_session(base_url: str, route: str, session: dict[str, Any]
                       ) -> tuple[websockets.ClientConnection, SessionCreated]:
    """Connect with autostart=0 and open with `session.update` (both routes accept it, §2.1 H4)."""
    ws = await websockets.connect(ws_url(base_url, route, autostart="0"), max_size=MAX_MESSAGE_BYTES)
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    ev = await _first_event(ws)
    if not isinstance(ev, SessionCreated):
        raise await _fail(ws, ev, "session open refused")
    return ws, ev


async def resume_session(base_url: str, route: str, creds: ResumeCredentials, last_received: int
                         ) -> tuple[websockets.ClientConnection, SessionCreated]:
    """One resume attempt (§6.4); replayed events follow `session.resumed` on the returned socket."""
    ws = await websockets.connect(ws_url(base_url, route, resume="1"), max_size=MAX_MESSAGE_BYTES)
    await ws.send(json.dumps(creds.resume_frame(last_received)))
    ev = await _first_event(ws)
    if not isinstance(ev, SessionCreated) or ev.type != "session.resumed":
        raise await _fail(ws, ev, "resume refused")
    return ws, ev
