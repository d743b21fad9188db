"""The commit table of protocol.md §3.7 (C1-C9) on real WebSockets with the fake runtime."""

from __future__ import annotations

from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


async def _commit(c, **fields) -> list[dict]:  # noqa: ANN001
    await c.send({"type": "input_audio_buffer.commit", **fields})
    return await c.until("conversation.item.done")


async def test_c6_empty_commit_is_one_error_and_nothing_else() -> None:
    async with session() as (c, rt):
        await c.send({"type": "input_audio_buffer.commit", "event_id": "c-1"})
        err = await c.recv()
        assert err["type"] == "error" and err["error"]["code"] == "input_audio_buffer_empty"
        assert err["error"]["event_id"] == "c-1" and "server_event_seq" not in err
        assert await c.quiet(0.2) == []
        events = await close(c)
    assert "response.created" not in types(events)
    assert_conformant(events)


async def test_c2_commit_then_model_speaks_new_response() -> None:
    async with session() as (c, rt):
        rt.plan[0] = Speak("Hello!", 600, end_of_turn=True)
        await c.send(append(400))
        got = await _commit(c)
        q = [e["type"] for e in got if e["type"] != "input_audio_buffer.speech_started"]
        assert q == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                     "conversation.item.added", "conversation.item.done"]
        committed = got[-3]
        assert committed["metadata"]["reason"] == "committed" and committed["metadata"]["audio_end_ms"] == 400
        out = await c.until("rate_limits.updated")
        created = next(e for e in out if e["type"] == "response.created")["response"]
        assert created["duplex"]["input_item_id"] == committed["item_id"]
        events = await close(c)
    # the residual was padded to one full unit 0 (16,480 samples) and submitted (final:true)
    assert rt.units_seen[0].unit_index == 0 and len(rt.units_seen[0].pcm) == 16480 * 4
    assert_conformant(events)


async def test_c1_auto_response_off_commits_without_response() -> None:
    async with session(update={"extra_body": {"auto_response": False}}) as (c, rt):
        rt.plan[0] = Speak("never", 600)
        await c.send(append(400))
        await _commit(c)
        await c.until("response.listen")  # unit 0 forced to listen (U-7)
        events = await close(c)
    assert "response.created" not in types(events)
    assert rt.units_seen[0].force_listen is True
    assert_conformant(events)


async def test_c5_non_speech_commit() -> None:
    async with session() as (c, rt):
        await c.send(append(400))
        got = await _commit(c, is_speech=False)
        listen = await c.recv()
        events = await close(c)
    committed = next(e for e in got if e["type"] == "input_audio_buffer.committed")
    assert committed["metadata"]["no_response"] is True and committed["metadata"]["reason"] == "non_speech"
    assert listen["type"] == "response.listen" and listen["model_unit_index"] is None
    assert listen["response"]["metadata"]["reason"] == "non_speech_commit"
    assert rt.units_seen == []  # no runtime append for a non-speech item
    assert_conformant(events)


async def test_c8_commit_with_response_create_precreates() -> None:
    async with session() as (c, rt):
        rt.plan[0] = Speak("Yes.", 500, end_of_turn=True)
        await c.send(append(400))
        await c.send({"type": "input_audio_buffer.commit", "response_create": True})
        got = await c.until("rate_limits.updated")
        events = await close(c)
    t = types(got)
    assert t.index("conversation.item.done") < t.index("response.created")
    created = next(e for e in got if e["type"] == "response.created")["response"]
    assert created["duplex"]["trigger"] == "response_create"
    assert_conformant(events)


async def test_c8_rejected_while_response_active() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("long ", 1000)
        await stream_units(c, 2)
        await c.until("response.speak")
        await c.send(append(200))
        await c.send({"type": "input_audio_buffer.commit", "response_create": True, "event_id": "x"})
        err = await c.until("error")
        assert err[-1]["error"]["code"] == "response_already_active"
        events = await close(c)
    assert_conformant(events)


async def test_c3_short_overlap_is_a_backchannel() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("talking ", 1000)
        rt.plan[2] = Speak("still ", 1000)
        await stream_units(c, 2)
        await c.until("response.speak")
        await c.send(append(200))  # 200 ms of speech during the response <= 700 ms
        got = await _commit(c)
        events = await close(c)
    first, decision = [e for e in got if e["type"] == "overlap.decision"]
    assert (first["action"], first["reason"]) == ("listen", "auto_response_continuous")  # O3 on the append
    assert decision["action"] == "drop" and decision["reason"] == "short_overlap_ack"
    committed = next(e for e in got if e["type"] == "input_audio_buffer.committed")
    assert committed["metadata"]["no_response"] is True
    assert_conformant(events)


async def test_c4_long_overlap_defers_and_promotes_with_new_response() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("talking ", 1000)
        rt.plan[2] = Speak("end.", 500, end_of_turn=True)
        rt.plan[3] = Speak("Answer.", 500, end_of_turn=True)
        await stream_units(c, 2)
        await c.until("response.speak")
        await c.send(append(900))  # > overlap_short_ack_ms
        got = await _commit(c)
        committed = next(e for e in got if e["type"] == "input_audio_buffer.committed")
        assert committed["metadata"]["response_create_deferred"] is True
        assert committed["metadata"]["reason"] == "deferred"
        first = await c.until("rate_limits.updated")  # unit 2 (padded by the promotion or by silence) ends it
        second = await c.until("rate_limits.updated", wait_s=5)
        events = await close(c)
    r1 = next(e for e in first if e["type"] == "response.done")["response"]
    r2 = next(e for e in second if e["type"] == "response.created")["response"]
    assert r2["id"] != r1["id"] and r2["duplex"]["trigger"] == "deferred_commit"
    assert r2["duplex"]["input_item_id"] == committed["item_id"]
    assert_conformant(events)


async def test_c9_pending_turns_backpressure() -> None:
    async with session(max_pending_turns_per_session=1) as (c, rt):
        rt.hold.clear()  # the runtime does not acknowledge: the first commit stays pending
        await c.send(append(300))
        await _commit(c)
        await c.send(append(300))
        await c.send({"type": "input_audio_buffer.commit", "event_id": "c9"})
        err = await c.until("error")
        rt.hold.set()
        events = await close(c)
    assert err[-1]["error"]["code"] == "input_backpressure" and err[-1]["error"]["retryable"] is True
    assert err[-1]["error"]["type"] == "rate_limit_error"
    assert_conformant(events)
