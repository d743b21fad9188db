"""The relay passes the owner gateway's close code and reason on to the client (a real websockets connection)."""

from __future__ import annotations

import websockets

from gateway.directory.relay import OWNER_LOST, _owner_to_client


class ClientSide:
    """The client's socket as the relay uses it: text frames out, then one close."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.closed: tuple[int, str] | None = None

    async def send_text(self, text: str) -> None:
        self.sent.append(text)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


async def test_the_owners_close_code_and_reason_reach_the_client() -> None:
    async def owner(conn: websockets.ServerConnection) -> None:
        await conn.send('{"type": "session.updated"}')
        await conn.close(4001, "session_resume_expired")

    async with websockets.serve(owner, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with websockets.connect(f"ws://127.0.0.1:{port}") as upstream:
            client = ClientSide()
            await _owner_to_client(upstream, client)
    assert client.sent == ['{"type": "session.updated"}']
    assert client.closed == (4001, "session_resume_expired")


async def test_an_owner_that_drops_without_a_close_frame_is_owner_lost() -> None:
    async def owner(conn: websockets.ServerConnection) -> None:
        conn.transport.abort()  # no close frame

    async with websockets.serve(owner, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with websockets.connect(f"ws://127.0.0.1:{port}") as upstream:
            client = ClientSide()
            await _owner_to_client(upstream, client)
    assert client.closed == OWNER_LOST
