"""Error codes of protocol.md §1.7 that need session state, runtime faults or special limits."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.runtime.base import StreamError
from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append, tone_clip
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


@pytest.mark.parametrize(("seconds", "amplitude"), [(0.1, 0.3), (1.0, 0.0), (1.0, 1e-4)])
async def test_a_clip_too_short_or_silent_for_a_voice_is_bad_audio(seconds: float, amplitude: float) -> None:
    async with session() as (c, rt):
        err = await _error(c, {"type": "session.update", "session": {"ref_audio": tone_clip(seconds, amplitude=amplitude)}})
        assert (err["error"]["code"], err["error"]["param"]) == ("bad_audio", "session.ref_audio")
        await c.send({"type": "session.update", "session": {"ref_audio": tone_clip()}})  # the session goes on
        upd = await c.until("session.updated")
        assert upd[-1]["session"]["ref_audio"]["source"] == "client"
        events = await close(c)
    assert_conformant(events)


async def _error(c, frame: dict) -> dict:  # noqa: ANN001
    await c.send(frame)
    return (await c.until("error"))[-1]


async def test_prefix_locked_fields_after_first_append() -> None:
    async with session(voices=("default", "v2")) as (c, rt):
        # before the prefix commit these are updatable (§2.6)
        await c.send({"type": "session.update", "session": {"instructions": "Be brief.", "voice": "v2",
                                                            "ref_audio": tone_clip()}})
        upd = await c.until("session.updated")
        assert upd[-1]["session"]["ref_audio"]["source"] == "client"
        assert "data" not in json.dumps(upd[-1]["session"]["ref_audio"])  # echoed as a descriptor only
        await stream_units(c, 1)
        await c.until("response.listen")
        codes = []
        for patch in ({"instructions": "Other."}, {"voice": "default"}, {"ref_audio": None},
                      {"extra_body": {"duplex_initial_user_text": "hi"}}):
            codes.append((await _error(c, {"type": "session.update", "session": patch}))["error"]["code"])
        # re-sending an unchanged locked value is not a change
        await c.send({"type": "session.update", "session": {"instructions": "Be brief.", "temperature": 0.5}})
        ok = await c.until("session.updated")
        events = await close(c)
    assert codes == ["instructions_update_after_audio_unsupported", "voice_update_after_audio_unsupported",
                     "ref_audio_update_unsupported", "bad_event"]
    assert ok[-1]["session"]["temperature"] == 0.5 and ok[-1]["session"]["prefix_committed"] is True
    assert_conformant(events)


async def test_update_runtime_failures_roll_back() -> None:
    async with session() as (c, rt):
        before = (await c.send({"type": "session.update", "session": {}}), await c.until("session.updated"))[1][-1]
        gen = before["session"]["config_generation"]
        got = {}
        for code in ("invalid_runtime_config", "internal_error", "runtime_backpressure"):
            rt.fail["update"] = code
            err = await _error(c, {"type": "session.update", "event_id": f"u-{code}",
                                   "session": {"temperature": 1.5, "extra_body": {"force_listen_count": 1}}})
            got[code] = (err["error"]["code"], err["error"]["event_id"])
        await c.send({"type": "session.update", "session": {"speed": 1.0}})  # identical runtime config
        after = (await c.until("session.updated"))[-1]
        events = await close(c)
    assert got == {"invalid_runtime_config": ("invalid_runtime_config", "u-invalid_runtime_config"),
                   "internal_error": ("runtime_update_failed", "u-internal_error"),
                   "runtime_backpressure": ("runtime_backpressure", "u-runtime_backpressure")}
    # U6: the old public config and config_generation stay in force; U4: identical candidates skip the runtime
    assert after["session"]["temperature"] == 0.7 and after["session"]["config_generation"] == gen
    assert after["session"]["extra_body"]["force_listen_count"] == 0
    assert_conformant(events)


async def test_update_waits_for_append_tail_and_times_out() -> None:
    async with session(runtime_timeout_s=0.3) as (c, rt):
        rt.hold.clear()
        await stream_units(c, 1)
        err = await _error(c, {"type": "session.update", "session": {"temperature": 1.0}})
        rt.hold.set()
        await close(c)
    assert err["error"]["code"] == "runtime_timeout" and err["error"]["retryable"] is True
    assert not [op for op in rt.ops if op[0] == "update"]


async def test_update_applies_after_earlier_appends() -> None:
    async with session() as (c, rt):
        rt.append_delay_s = 0.2
        await stream_units(c, 1)
        await c.send({"type": "session.update", "session": {"temperature": 1.1}})
        await c.until("session.updated")
        events = await close(c)
    ops = [op[0] for op in rt.ops]
    # U3: the earlier append was acknowledged before the runtime update was sent
    assert ops.index("append") < ops.index("update")
    assert rt.configs[-1]["temperature"] == 1.1
    assert_conformant(events)


async def test_ref_audio_required_for_autostarted_session_without_voice() -> None:
    async with session(default_voice_available=False) as (c, rt):
        err = await _error(c, append(100))
        await c.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
        await c.until("session.updated")
        await c.send(append(100))
        await c.quiet(0.2)
        events = await close(c)
    assert err["error"]["code"] == "ref_audio_required"
    assert "error" not in types(events[types(events).index("session.updated"):])


async def test_event_too_large_and_byte_backpressure() -> None:
    async with session(max_frame_bytes=20000, max_pending_input_bytes_per_session=3000) as (c, rt):
        big = await _error(c, append(1000))  # 32 kB of base64 > 20 kB frame limit
        rt.hold.clear()
        await c.send(append(90))  # 2880 B pending, under the 3000 B limit
        bp = await _error(c, append(10))
        rt.hold.set()
        events = await close(c)
    assert big["error"]["code"] == "event_too_large"
    assert bp["error"]["code"] == "input_backpressure"
    assert_conformant(events)


async def test_item_errors_with_state() -> None:
    async with session() as (c, rt):
        rt.plan[0] = Speak("Hi there", 800)
        rt.plan[1] = Speak("more", 800)
        await c.send(append(300))
        await c.send({"type": "input_audio_buffer.commit"})
        committed = [e for e in await c.until("conversation.item.done")
                     if e["type"] == "input_audio_buffer.committed"][0]
        user = committed["item_id"]
        speak = (await c.until("response.output_audio_transcript.delta"))
        rid = next(e for e in speak if e["type"] == "response.created")["response"]["id"]
        codes = [
            (await _error(c, {"type": "conversation.item.truncate", "item_id": user, "audio_end_ms": 0}))["error"]["code"],
            (await _error(c, {"type": "conversation.item.delete", "item_id": f"item_{rid}"}))["error"]["code"],
            (await _error(c, {"type": "conversation.item.truncate", "item_id": f"item_{rid}",
                              "audio_end_ms": 99999}))["error"]["code"],
            (await _error(c, {"type": "response.cancel", "response_id": "resp_other"}))["error"]["code"],
            (await _error(c, {"type": "playback.ack", "response_id": rid, "item_id": "item_x",
                              "played_ms": 1}))["error"]["code"],
        ]
        await c.send(append(100))
        codes.append((await _error(c, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": ""}]}}))["error"]["code"])
        await c.send({"type": "input_audio_buffer.clear"})
        await c.until("input_audio_buffer.cleared")
        codes.append((await _error(c, {"type": "conversation.item.create", "previous_item_id": "item_zzz", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": ""}]}}))["error"]["code"])
        events = await close(c)
    assert codes == ["item_not_truncatable", "bad_event", "bad_event", "response_not_active", "bad_event",
                     "bad_event", "bad_event"]
    assert_conformant(events)


async def test_runtime_append_failure_fails_active_response_then_reports() -> None:
    async with session() as (c, rt):
        rt.fail["append"] = "internal_error"
        await stream_units(c, 1)
        report = (await c.until("error"))[-1]
        assert report["error"]["code"] == "runtime_append_failed" and "server_event_seq" in report
        rt.plan[1] = Speak("a", 500)
        await stream_units_more(c, 1)
        await c.until("response.speak")
        rt.fail["append"] = "internal_error"
        await stream_units_more(c, 1)
        got = await c.until("rate_limits.updated")
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "runtime_append_failed"
    t = types(got)
    assert t.index("error") < t.index("response.done")
    assert_conformant(events)


async def stream_units_more(c, units: int) -> None:  # noqa: ANN001
    for _ in range(units * 5):
        await c.send(append(200))


async def test_stream_failure_and_signal_failure() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("a", 500)
        rt.plan[2] = Speak("b", 500)
        await stream_units(c, 2)
        await c.until("response.speak")
        corr = next(iter(rt.seqs))
        rt.inject(corr, StreamError(epoch=0, code="talker_crashed", message="boom"))
        got = await c.until("rate_limits.updated")
        rt.plan[3] = Speak("c", 500)
        rt.fail["cancel"] = "internal_error"
        await stream_units_more(c, 2)
        await c.until("response.speak")
        await c.send({"type": "response.cancel"})
        sig = await c.until("error")
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "failed" and done["duplex"]["reason"] == "runtime_stream_failed"
    assert sig[-1]["error"]["code"] == "runtime_signal_failed"
    assert_conformant(events)


async def test_runtime_close_failure_sets_cleanup_pending() -> None:
    async with session() as (c, rt):
        rt.fail["close"] = "internal_error"
        await c.send({"type": "session.close", "reason": "bye"})
        got = await c.until("session.closed")
    err = next(e for e in got if e["type"] == "error")
    closed = got[-1]
    assert err["error"]["code"] == "runtime_close_failed"
    assert closed["cleanup_pending"] is True and closed["client_reason"] == "bye" and closed["reason"] == "client_close"


async def test_runtime_dead_closes_session() -> None:
    async with session() as (c, rt):
        corr = next(iter(rt.seqs))
        rt.seqs[corr].queue.put_nowait(None)  # the runtime's stream for this session ends on its own
        got = await c.until("session.closed")
        await asyncio.sleep(0)
    err = next(e for e in got if e["type"] == "error")
    assert err["error"]["code"] == "runtime_dead" and got[-1]["reason"] == "runtime_failure"


async def test_internal_fault_closes_with_internal_error() -> None:
    async with session() as (c, rt):
        corr = next(iter(rt.seqs))
        rt.seqs[corr].queue.put_nowait(object())  # not a runtime event: a gateway bug surfaces as internal_error
        got = await c.until("session.closed")
    err = next(e for e in got if e["type"] == "error")
    assert err["error"]["code"] == "internal_error" and got[-1]["reason"] == "internal_error"
