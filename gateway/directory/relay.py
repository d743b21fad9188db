"""A resume for a session another gateway owns: relay the socket, frame for frame, to the owner.

The owner runs the whole resume procedure (§6.4) against its own session: it checks the token, rotates it,
replays its journal and then streams live events. This gateway only copies text frames both ways, unchanged
(so the replay is byte-exact), and ends each side the way the other side ended (close code and reason). The
client's route, query, subprotocol and credentials go to the owner as they came, so the owner applies the same
route/profile checks (RS4) and authentication as if the client had reached it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

import websockets
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.directory.adopt import adopt
from gateway.protocol.errors import Effect, ProtocolError

if TYPE_CHECKING:
    from gateway.state import GatewayState

# no close frame from the owner (it died mid-relay): the client sees the socket end as a lost server, 1011, and
# resumes again (which then gets runtime_resume_failed until the owner's lease runs out, then adopts the session)
OWNER_LOST = (1011, "owner_gateway_lost")
FORWARDED_HEADERS = ("authorization",)


async def relayed_to_owner(gw: GatewayState, ws: WebSocket, opener: dict[str, Any]) -> bool:
    """A resume of a session owned by another live gateway: relay it there (True). False: resume here: a dead
    gateway's session is adopted first (adopt.py); for an unknown session the local procedure answers
    `session_resume_expired`. A session this gateway holds is checked too: while it was cut off from Redis past
    its lease another gateway may have adopted it, and this copy is stale until the ownership check fences it."""
    directory, sid = gw.directory, opener.get("session_id")
    if directory is None or not isinstance(sid, str):
        return False
    try:
        entry = await directory.lookup(sid)
    except Exception as exc:  # noqa: BLE001 - Redis unreachable: the client retries with backoff (CL-3)
        raise ProtocolError("runtime_resume_failed", f"session directory: {exc.__class__.__name__}",
                            effect=Effect.HANDSHAKE) from exc
    if entry is None or entry.owner == directory.addr:
        return False
    if sid in gw.sessions and not entry.owner_alive:
        return False  # our own stale copy and a dead adopter: the ownership check settles it, resume here
    if not entry.owner_alive:  # its gateway died: take the session over here, then resume it here (adopt.py)
        if gw.host_factory is not None:
            await adopt(gw, entry, opener.get("resume_token"))
        return False
    await relay_resume(ws, entry.owner, opener, max_size=gw.settings.ws_max_message_bytes)
    return True


def owner_url(owner: str, ws: WebSocket) -> str:
    query = ws.url.query
    return f"ws://{owner}{ws.url.path}" + (f"?{query}" if query else "")


def _subprotocols(ws: WebSocket) -> list[Any]:
    return [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]


async def relay_resume(ws: WebSocket, owner: str, opener: dict[str, Any], *, max_size: int | None = None) -> None:
    """`ws` is accepted and its `session.resume` frame (`opener`) read; returns when either side has ended. An
    owner that cannot be reached is `runtime_resume_failed` (retryable, §6.6 CL-3): the session, if the owner
    still runs, stays detached there; if it died, its lease runs out and a later retry is told so."""
    headers = {h: ws.headers[h] for h in FORWARDED_HEADERS if h in ws.headers}
    try:
        upstream = await websockets.connect(owner_url(owner, ws), subprotocols=_subprotocols(ws) or None,
                                            additional_headers=headers, max_size=max_size, open_timeout=5)
    except (OSError, websockets.WebSocketException, TimeoutError) as exc:
        raise ProtocolError("runtime_resume_failed", f"the gateway owning the session does not answer: "
                            f"{exc.__class__.__name__}", effect=Effect.HANDSHAKE) from exc
    async with upstream:
        await upstream.send(json.dumps(opener))
        down = asyncio.create_task(_owner_to_client(upstream, ws), name="relay-down")
        up = asyncio.create_task(_client_to_owner(ws, upstream), name="relay-up")
        done, pending = await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _owner_to_client(upstream: Any, ws: WebSocket) -> None:
    try:
        async for text in upstream:
            await ws.send_text(text if isinstance(text, str) else text.decode())
    except websockets.ConnectionClosed:
        pass
    except (WebSocketDisconnect, RuntimeError, OSError):
        return  # the client is gone: leaving closes the upstream socket as a client loss (the owner detaches)
    rcvd = upstream.protocol.close_rcvd  # the owner's close frame (None: the connection just dropped)
    await _close(ws, *((rcvd.code, rcvd.reason) if rcvd is not None else OWNER_LOST))


async def _client_to_owner(ws: WebSocket, upstream: Any) -> None:
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return  # leaving closes the upstream socket: the owner sees the client go
            if msg.get("text") is not None:
                await upstream.send(msg["text"])
            elif msg.get("bytes") is not None:
                await upstream.send(msg["bytes"])  # the owner ignores binary frames as §1.3 says
    except (WebSocketDisconnect, RuntimeError, OSError, websockets.ConnectionClosed):
        return


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
        await ws.close(code, reason)
