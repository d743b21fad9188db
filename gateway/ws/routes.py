"""The WebSocket routes `/v1/realtime` and `/v1/duplex` (protocol.md §1.1)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from gateway.protocol.errors import Effect, ProtocolError
from gateway.ws.connection import Connection
from gateway.ws.handshake import parse_params

router = APIRouter()


async def _serve(ws: WebSocket, route: str) -> None:
    subprotocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    params, error = None, None
    headers = {k.lower(): v for k, v in ws.headers.items()}
    try:
        params = parse_params(route, dict(ws.query_params), headers, subprotocols)
    except ProtocolError as err:
        err.effect = Effect.HANDSHAKE
        error = err
    try:  # after the params, so that a refusal still echoes the subprotocol a browser needs to read it
        ws.app.state.gateway.auth.check_websocket(headers, subprotocols)  # invalid_api_key / origin_not_allowed
    except ProtocolError as err:
        error = err  # an auth refusal hides any parameter error
    conn = Connection(ws, params, ws.app.state.gateway)
    if error is not None and route == "/v1/duplex":
        from gateway.protocol.profiles import Profile  # noqa: PLC0415
        from gateway.ws.handshake import ConnectionParams  # noqa: PLC0415

        conn.params = ConnectionParams(route, Profile.NATIVE, False, False, None, None)
    await conn.serve(error)


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    await _serve(ws, "/v1/realtime")


@router.websocket("/v1/duplex")
async def duplex(ws: WebSocket) -> None:
    await _serve(ws, "/v1/duplex")
