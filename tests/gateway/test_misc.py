"""Smaller rules: heartbeat, binary frames, force-listen (U-7), frames binding (V-3), truncate of a live
response (TR-3), outbound overflow (§1.5)."""

from __future__ import annotations

import base64

import pytest

from gateway.protocol.errors import Effect, ProtocolError
from gateway.session.outbox import Outbox, OutboxLimits, OutboxOverflow, OutItem
from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(8)).decode()


async def test_heartbeat_and_binary_frames() -> None:
    async with session() as (c, rt):
        await c.ws.send(b"\x00\x01binary")  # ignored, no error (§1.3)
        await c.send({"type": "session.heartbeat"})
        ack = await c.recv()
        events = await close(c)
    assert ack["type"] == "session.heartbeat_ack" and "server_event_seq" not in ack
    assert "error" not in types(events)
    assert_conformant(events)


async def test_force_listen_count_and_per_append_force_listen() -> None:
    async with session(force_listen_count=2) as (c, rt):
        await stream_units(c, 3)
        await c.until("response.listen", model_unit_index=2)
        await c.send({"type": "session.update", "session": {"extra_body": {"force_listen_count": 1}}})
        await c.until("session.updated")
        for _ in range(5):
            await c.send(append(200))  # unit 3: forced again by the reset count
        for _ in range(4):
            await c.send(append(200))
        await c.send(append(200, force_listen=True))  # closes unit 4
        await c.until("response.listen", model_unit_index=4)
        events = await close(c)
    assert [u.force_listen for u in rt.units_seen] == [True, True, False, True, True]
    assert_conformant(events)


async def test_video_frames_bind_to_the_unit_of_the_first_sample() -> None:
    async with session() as (c, rt):
        for i in range(6):  # 0..1200 ms: the 6th append crosses the 1030 ms boundary
            await c.send(append(200, video_frames=[PNG]) if i == 5 else append(200))
        await c.until("response.listen")
        events = await close(c)
    assert len(rt.units_seen[0].frames) == 1 and rt.units_seen[0].frames[0].startswith(b"\x89PNG")
    assert_conformant(events)


async def test_truncate_live_response_cancels_it() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Hello there ", 1000)
        rt.plan[2] = Speak("friend ", 1000)
        await stream_units(c, 2)
        got = await c.until("response.output_audio_transcript.delta")
        rid = next(e for e in got if e["type"] == "response.created")["response"]["id"]
        await c.send({"type": "conversation.item.truncate", "item_id": f"item_{rid}", "audio_end_ms": 400})
        got = await c.until("conversation.item.truncated")
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled" and done["duplex"]["reason"] == "truncated"
    assert types(got).index("rate_limits.updated") < types(got).index("conversation.item.truncated")
    assert_conformant(events)


def test_outbox_limits_and_reserve() -> None:
    box = Outbox(OutboxLimits(max_bytes=10_000, max_events=2, reserve_bytes=1000, reserve_events=1))
    box.put(OutItem(events=({"type": "a"},)))
    box.put(OutItem(events=({"type": "b"},)))
    with pytest.raises(OutboxOverflow):
        box.put(OutItem(events=({"type": "c"},)))
    box.put(OutItem(events=({"type": "terminal"},)), reserved=True)  # terminals may use the reserve
    with pytest.raises(OutboxOverflow):
        box.put(OutItem(events=({"type": "d"},)), reserved=True)


async def test_overflow_maps_to_close_session_error() -> None:
    from gateway.session.core import SessionCore

    core = SessionCore.__new__(SessionCore)
    core.outbox = Outbox(OutboxLimits(max_bytes=100, max_events=1, reserve_bytes=0, reserve_events=0))
    core.emit({"type": "x"})
    with pytest.raises(ProtocolError) as exc:
        core.emit({"type": "y"})
    assert exc.value.code == "output_buffer_overflow" and exc.value.effect is Effect.CLOSE_SESSION


async def test_initial_user_text_counts_as_committed_input() -> None:
    async with session(update={"extra_body": {"duplex_initial_user_text": "Tell me a joke."}}) as (c, rt):
        rt.plan[0] = Speak("Why did", 1000, end_of_turn=True)
        await c.send({"type": "response.create"})
        got = await c.until("rate_limits.updated", wait_s=4)  # silence continuation feeds unit 0
        await c.send({"type": "response.create", "event_id": "again"})
        err = await c.until("error")
        events = await close(c)
    assert rt.configs[-1]["initial_user_text"] == "Tell me a joke."  # reached the runtime before the prefix
    assert next(e for e in got if e["type"] == "response.done")["response"]["duplex"]["decision"] == "speak"
    assert err[-1]["error"]["code"] == "response_create_without_input"  # consumed by the spoken response
    assert_conformant(events)


async def test_idle_expiry_cancels_and_ends_with_session_expired() -> None:
    import websockets

    async with session(update={"idle_timeout_s": 0.6}) as (c, rt):
        rt.plan[1] = Speak("talking ", 1000)
        rt.plan[2] = Speak("on ", 1000)
        await stream_units(c, 2)
        got = await c.until("session.expired", wait_s=3)
        with pytest.raises(websockets.ConnectionClosed) as exc:
            await c.recv()
    assert got[-1]["reason"] == "idle_ttl_expired" and (exc.value.rcvd.code, exc.value.rcvd.reason) == (
        1000, "session_expired")
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["duplex"]["reason"] == "session_expired" and done["status_details"] == {"type": "cancelled"}
    assert_conformant(c.events)
