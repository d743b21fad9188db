"""Resume, takeover, grace expiry, event_ack and the journal (§6) through the real gateway over WebSockets."""

from __future__ import annotations

import asyncio

import websockets

from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import append, serve
from tests.gateway.scenario import UNIT0_MS, UNIT_MS
from tests.gateway_ops.test_wired_admission import admits
from tests.gateway_ops.wire import Raw, eventually, http_get, metric, opened, resume

CHUNK_MS = 200


async def stream(c: Raw, units: int) -> None:
    total, sent = UNIT0_MS + (units - 1) * UNIT_MS, 0
    while sent < total:
        ms = min(CHUNK_MS, total - sent)
        await c.send(append(ms))
        sent += ms


async def scenario_resume_replays_and_rotates(addr: str, rt: FakeRuntime | None = None) -> None:
    """Resume within grace: missed events replayed byte-exact, token rotated, the old token then fails."""
    c, created = await opened(addr)
    sid, token = created["session"]["id"], created["resume_token"]
    assert created["attachment_generation"] == 1 and len(token) == 43
    await stream(c, 3)
    await c.quiet(1.0)  # whatever the model did (the fake speaks; a real one may listen): sequenced events
    seen = c.by_seq()
    assert len(seen) >= 2, c.events
    cursor = min(seen)  # pretend only the first sequenced event was processed
    await c.ws.close()  # a drop without session.close: the session detaches and keeps generating
    b, resumed = await resume(addr, sid, token, cursor)
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["attachment_generation"] == 2 and resumed["incarnation"] == created["incarnation"]
    assert resumed["resume_token"] != token and len(resumed["resume_token"]) == 43
    assert resumed["replay_from_seq"] == cursor + 1 and resumed["last_server_event_seq"] >= max(seen)
    replay = [await b.recv() for _ in range(resumed["replay_count"])]
    assert [e["server_event_seq"] for e in replay] == list(range(cursor + 1, resumed["last_server_event_seq"] + 1))
    assert b.texts[1:1 + len(seen) - 1] == [seen[s] for s in sorted(seen) if s > cursor]  # byte-exact (J-6)
    await b.send({"type": "session.heartbeat"})  # a first frame on the new attachment revokes the old token
    ack = await b.until("session.heartbeat_ack")
    assert ack["lease_expires_in_s"] is not None and ack["lease_expires_in_s"] > 0
    stale, err = await resume(addr, sid, token, 0)
    assert err["error"]["code"] == "invalid_resume_token" and await stale.closed() == (1008, "invalid_resume_token")
    await b.send({"type": "session.close"})
    await b.until("session.closed")
    await b.ws.close()


async def test_resume_within_grace_replays_byte_exact_and_rotates_token() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("hello there ", 1000, end_of_turn=True)
    async with serve(rt) as addr:
        await scenario_resume_replays_and_rotates(addr)
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_resume_total", result="ok") == 1
    assert metric(text, "duplex_resume_total", result="invalid_resume_token") == 1


async def test_events_generated_while_detached_are_journaled_and_replayed() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("while you were away ", 1000, end_of_turn=True)
    async with serve(rt) as addr:
        c, created = await opened(addr)
        rt.hold.clear()  # the runtime sits on the appends until after the drop
        await stream(c, 2)
        await asyncio.sleep(0.2)
        cursor = c.last_seq
        await c.ws.close()
        await asyncio.sleep(0.1)
        rt.hold.set()  # the response is generated while nobody is attached
        await asyncio.sleep(0.3)
        text = (await http_get(addr, "/metrics")).text
        assert metric(text, "duplex_sessions", state="detached") == 1  # slot kept through the grace period
        b, resumed = await resume(addr, created["session"]["id"], created["resume_token"], cursor)
        replay = [await b.recv() for _ in range(resumed["replay_count"])]
        assert "response.output_audio.delta" in [e["type"] for e in replay]
        assert "response.done" in [e["type"] for e in replay] and replay[0]["server_event_seq"] == cursor + 1
        await b.ws.close()


async def scenario_takeover(addr: str) -> None:
    """TK-1/TK-2: a valid resume while attached replaces the old socket."""
    a, created = await opened(addr)
    sid = created["session"]["id"]
    b, resumed = await resume(addr, sid, created["resume_token"], 0)
    assert resumed["type"] == "session.resumed" and resumed["attachment_generation"] == 2
    replaced = await a.until("session.replaced")
    assert replaced == {"type": "session.replaced", "event_id": replaced["event_id"], "session_id": sid,
                        "attachment_generation": 1, "reason": "takeover"}
    assert await a.closed() == (1000, "session_replaced")
    await b.send({"type": "session.heartbeat"})
    assert (await b.until("session.heartbeat_ack"))["session_id"] == sid  # the new socket owns the session
    await b.send({"type": "session.close"})
    assert (await b.until("session.closed"))["reason"] == "client_close"
    await b.ws.close()


async def test_takeover() -> None:
    async with serve(FakeRuntime()) as addr:
        await scenario_takeover(addr)
        assert metric((await http_get(addr, "/metrics")).text, "duplex_takeover_total") == 1


async def scenario_grace_expiry(addr: str) -> None:
    """After `disconnect_grace_s` the session is gone: resume → session_resume_expired; the slot is free."""
    c, created = await opened(addr)
    limits = created["session"]["limits"]
    await c.ws.close()
    await asyncio.sleep(limits["disconnect_grace_s"] + limits["reaper_interval_s"] + 0.5)
    late, err = await resume(addr, created["session"]["id"], created["resume_token"], 0)
    assert err["error"]["code"] == "session_resume_expired" and (await late.closed())[0] == 1008
    await eventually(lambda: admits(addr))


async def test_grace_expiry_gives_session_resume_expired() -> None:
    rt = FakeRuntime()
    async with serve(rt, max_sessions=1, disconnect_grace_s=0.3) as addr:
        await scenario_grace_expiry(addr)
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_sessions_ended_total", reason="disconnect_grace_expired") == 1
    assert ("close", next(f for op, f in rt.ops if op == "open")) in rt.ops  # the runtime was closed


async def test_event_ack_trims_the_journal_and_bad_acks_are_rejected() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("acked ", 1000, end_of_turn=True)
    async with serve(rt) as addr:
        c, created = await opened(addr)
        await stream(c, 2)
        await c.until("response.done")
        await c.quiet(0.2)
        last = c.last_seq
        await c.send({"type": "session.event_ack", "server_event_seq": last + 5, "event_id": "bad"})
        err = await c.until("error")
        assert err["error"]["code"] == "invalid_event_ack" and "server_event_seq" not in err
        await c.send({"type": "session.event_ack", "server_event_seq": last - 1})
        await c.send({"type": "session.heartbeat"})
        await c.until("session.heartbeat_ack")
        await c.ws.close()
        b, resumed = await resume(addr, created["session"]["id"], created["resume_token"], 0)
        replay = [await b.recv() for _ in range(resumed["replay_count"])]
        assert [e["server_event_seq"] for e in replay] == [last]  # everything <= the ack is gone (J-2)
        assert resumed["replay_from_seq"] == last
        await b.ws.close()


async def test_journal_overflow_sends_resync_and_ends_resumability() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("a long answer " * 4, 1000, end_of_turn=True)
    async with serve(rt, max_sessions=1, resume_replay_max_bytes_per_session=4000) as addr:
        c, created = await opened(addr)
        await stream(c, 2)
        resync = await c.until("session.resync_required")
        assert resync["reason"] == "journal_overflow" and "server_event_seq" not in resync
        done = await c.until("response.done")
        assert "server_event_seq" not in done  # §1.4: unsequenced after the overflow
        await c.ws.close()  # non-resumable now: a drop closes the session (§6.2)
        late, err = await resume(addr, created["session"]["id"], created["resume_token"], 0)
        assert err["error"]["code"] in ("session_resume_expired", "unsupported_session_resume")
        await eventually(lambda: admits(addr))
        assert metric((await http_get(addr, "/metrics")).text, "duplex_journal_overflow_total") == 1


async def test_journal_gap_at_resume_gives_resync_required_and_ends_the_session() -> None:
    rt = FakeRuntime()
    rt.plan[1] = Speak("soon forgotten ", 1000, end_of_turn=True)
    async with serve(rt, max_sessions=1, resume_replay_ttl_s=0.2) as addr:
        c, created = await opened(addr)
        await stream(c, 2)
        await c.until("response.done")
        await c.ws.close()
        await asyncio.sleep(0.4)  # J-3: the unacknowledged entries age out
        late, first = await resume(addr, created["session"]["id"], created["resume_token"], 0)
        assert first["type"] == "session.resync_required" and first["reason"] == "journal_gap"
        assert "server_event_seq" not in first and first["last_server_event_seq"] > 0
        assert await late.closed() == (1000, "resync_required")
        await eventually(lambda: admits(addr))  # J-5: the session was closed, its slot freed
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_sessions_ended_total", reason="resync_required") == 1


async def test_native_session_resumes_only_on_its_route() -> None:
    async with serve(FakeRuntime()) as addr:
        async with websockets.connect(f"ws://{addr}/v1/duplex") as ws:
            c = Raw(ws)
            await c.send({"type": "session.create"})
            created = await c.recv()
            sid, token = created["session"]["id"], created["resume_token"]
        wrong, err = await resume(addr, sid, token, 0)  # RS4: /v1/realtime is not the session's route
        assert err["error"]["code"] == "unsupported_session_resume" and (await wrong.closed())[0] == 1008
        async with websockets.connect(f"ws://{addr}/v1/duplex") as ws:
            c = Raw(ws)
            await c.send({"type": "session.resume", "session_id": sid, "resume_token": token,
                          "last_received_server_event_seq": 0})
            resumed = await c.recv()
            assert resumed["type"] == "session.resumed" and resumed["attachment_generation"] == 2
