"""Graceful shutdown through `gateway.serving.DrainingServer` (session.closed{shutdown}, close 1001), and
TK-3: frames of a replaced socket have no effect."""

from __future__ import annotations

import asyncio

from gateway.protocol import client_events as ce
from gateway.serving import drain
from gateway.ws.messages import Admitted
from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.harness import append
from tests.gateway_ops.inproc import serve_app
from tests.gateway_ops.wire import http_get, metric, opened, raw, resume


async def test_shutdown_drains_sessions_with_1001() -> None:
    rt = FakeRuntime()
    async with serve_app(rt, max_sessions=4) as (addr, app, _):
        attached, _ = await opened(addr)
        detached, _ = await opened(addr)
        await detached.ws.close()  # a detached session is closed by the drain as well
        assert (await http_get(addr, "/ready")).status_code == 200
        draining = asyncio.create_task(drain(app.state.gateway))
        closed = await attached.until("session.closed")
        assert closed["reason"] == "shutdown" and closed["cleanup_pending"] is False
        assert await attached.closed() == (1001, "shutdown")
        await draining
        assert (await http_get(addr, "/ready")).status_code == 503
        async with raw(addr) as late:
            assert (await late.recv())["error"]["code"] == "runtime_unavailable"
        assert app.state.gateway.sessions == {} and len(app.state.gateway.admission) == 0
    assert sum(op == "close" for op, _ in rt.ops) == 2  # both runtime sessions were cleaned up


async def test_server_exit_goes_through_the_drain() -> None:
    async with serve_app(FakeRuntime()) as (addr, _, server):
        c, _ = await opened(addr)
        server.should_exit = True  # what SIGTERM does
        assert (await c.until("session.closed"))["reason"] == "shutdown"
        assert await c.closed() == (1001, "shutdown")


async def test_frames_of_a_replaced_socket_are_discarded() -> None:
    rt = FakeRuntime()
    async with serve_app(rt) as (addr, app, _):
        a, created = await opened(addr)
        sid = created["session"]["id"]
        b, resumed = await resume(addr, sid, created["resume_token"], 0)
        assert resumed["attachment_generation"] == 2
        await a.closed()
        live = app.state.gateway.sessions[sid]
        frame = append(200, event_id="late-from-old-socket")
        live.post(Admitted(ce.InputAudioBufferAppend(**frame), frame, 1))  # queued before the takeover landed
        live.post(Admitted(ce.SessionClose(type="session.close"), {"type": "session.close"}, 1))
        await b.send({"type": "session.heartbeat"})
        await b.until("session.heartbeat_ack")
        await b.quiet(0.2)
        assert [e["type"] for e in b.events] == ["session.resumed", "session.heartbeat_ack"]  # no effect, no reply
        assert metric((await http_get(addr, "/metrics")).text, "duplex_input_appends_total") == 0
        assert live.session.state == "open"
        await b.ws.close()
