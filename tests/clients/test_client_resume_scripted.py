"""Resume against a scripted server (no gateway): token use, cursor, dedup of the replay, event_ack."""

import asyncio
import json

import websockets

from clients import DuplexClient


def _ev(seq: int) -> str:
    return json.dumps({"type": "response.listen", "event_id": f"evt_{seq}", "server_event_seq": seq,
                       "response_id": None, "model_unit_index": seq, "response": {"metadata": {"reason": "model_listen"}}})


async def test_client_resumes_with_its_cursor_and_drops_replayed_events() -> None:
    resume_frames: list[dict] = []
    acks: list[int] = []

    async def handler(ws: websockets.ServerConnection) -> None:
        first = json.loads(await ws.recv())
        if first["type"] == "session.update":
            await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_x"}, "incarnation": 1,
                                      "attachment_generation": 1, "resume_token": "tok1"}))
            for seq in (1, 2, 3):
                await ws.send(_ev(seq))
            await asyncio.sleep(0.05)
            ws.transport.abort()  # the network drops
            return
        resume_frames.append(first)
        await ws.send(json.dumps({"type": "session.resumed", "session_id": "sess_x", "session": {"id": "sess_x"},
                                  "attachment_generation": 2, "resume_token": "tok2", "replay_count": 2}))
        for seq in (2, 3, 4, 5):  # a replay that overlaps what the client already processed
            await ws.send(_ev(seq))
        async for msg in ws:
            frame = json.loads(msg)
            if frame["type"] == "session.event_ack":
                acks.append(frame["server_event_seq"])
            if frame["type"] == "session.close":
                await ws.send(json.dumps({"type": "session.closed", "server_event_seq": 6, "session_id": "sess_x",
                                          "reason": "client_close"}))
                await ws.close()

    async with websockets.serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        c = DuplexClient(f"http://127.0.0.1:{port}")
        await c.connect()
        await c.wait_for("response.listen", timeout=5, where=lambda ev: ev.seq == 5)
        await asyncio.sleep(1.2)  # one ack period
        await c.close()
    assert resume_frames == [{"type": "session.resume", "session_id": "sess_x", "resume_token": "tok1",
                              "last_received_server_event_seq": 3, "incarnation": 1}]
    seqs = [ev.seq for ev in c.history if ev.seq is not None]
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert c.resumes == 1 and acks and max(acks) == 5
