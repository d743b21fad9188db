"""Backpressure (§5.1, §3.1.1, C9) and leases (§5.1) through the real gateway: rejected before any state change."""

from __future__ import annotations

import asyncio

from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import append, serve
from tests.gateway_ops.test_wired_resume import stream
from tests.gateway_ops.wire import Raw, http_get, metric, opened

RATE = 16000
BYTES_PER_MS = RATE // 1000 * 2  # pcm16 mono


async def _committed(c: Raw, **extra: object) -> dict:
    await c.send({"type": "input_audio_buffer.commit", **extra})
    return await c.until("input_audio_buffer.committed")


async def scenario_byte_backpressure(addr: str, hold: asyncio.Event, accepted_ms: int) -> None:
    c, _ = await opened(addr)
    hold.clear()  # the runtime stops acknowledging appends
    await c.send(append(accepted_ms))
    await c.quiet(0.2)
    seen = len(c.events)
    await c.send(append(50, event_id="over"))
    err = await c.until("error")
    assert err["error"]["code"] == "input_backpressure" and err["error"]["event_id"] == "over"
    assert err["error"]["type"] == "rate_limit_error" and "server_event_seq" not in err
    await c.quiet(0.2)
    assert c.events[seen:] == [err]  # the rejection emitted nothing else
    seq_before = c.last_seq
    hold.set()
    committed = await _committed(c)
    md = committed["metadata"]
    assert md["audio_end_ms"] - md["audio_start_ms"] == accepted_ms  # the rejected append left no trace
    assert committed["server_event_seq"] > seq_before
    await c.ws.close()


async def test_pending_input_bytes_backpressure_before_any_state_change() -> None:
    rt = FakeRuntime()
    accepted_ms = 90
    async with serve(rt, max_pending_input_bytes_per_session=accepted_ms * BYTES_PER_MS + 100) as addr:
        await scenario_byte_backpressure(addr, rt.hold, accepted_ms)
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_input_backpressure_total", kind="bytes") == 1


async def test_pending_turns_backpressure_keeps_the_item_open() -> None:
    rt = FakeRuntime()
    async with serve(rt, max_pending_turns_per_session=1) as addr:
        c, _ = await opened(addr)
        rt.hold.clear()
        await c.send(append(300))
        await _committed(c)
        await c.send(append(200))
        await c.send({"type": "input_audio_buffer.commit", "event_id": "c2"})
        err = await c.until("error")
        assert err["error"]["code"] == "input_backpressure" and err["error"]["event_id"] == "c2"
        rt.hold.set()
        await asyncio.sleep(0.2)
        committed = await _committed(c)  # C9: the item stayed open with its audio
        assert committed["metadata"]["audio_end_ms"] - committed["metadata"]["audio_start_ms"] == 200
        await c.ws.close()
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_input_backpressure_total", kind="turns") == 1


async def test_idle_ttl_expiry_through_the_lease_and_heartbeat_keeps_alive() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("still talking ", 1000)
    async with serve(rt, idle_ttl_s=1.0) as addr:
        c, created = await opened(addr)
        assert created["session"]["limits"]["idle_ttl_s"] == 1.0
        for _ in range(4):  # heartbeats are accepted client events: they restart the idle TTL
            await asyncio.sleep(0.3)
            await c.send({"type": "session.heartbeat"})
            ack = await c.until("session.heartbeat_ack")
            assert 0.5 < ack["lease_expires_in_s"] <= 1.0
        await stream(c, 2)
        expired = await c.until("session.expired", wait_s=3)
        assert expired["reason"] == "idle_ttl_expired" and "server_event_seq" in expired
        assert await c.closed() == (1000, "session_expired")
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_sessions_ended_total", reason="idle_ttl_expired") == 1
