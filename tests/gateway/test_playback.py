"""Playback ledger, acks, truncation, history commit and marks (protocol.md §7), items and response options."""

from __future__ import annotations

import base64

from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append, pcm16_b64
from tests.gateway.scenario import assert_conformant, close, session, stream_units


async def _spoken(c, rt, **update) -> str:  # noqa: ANN001, ANN003
    rt.plan[1] = Speak("Sure, one ", 1000)
    rt.plan[2] = Speak("plus one is two.", 840, end_of_turn=True)
    await stream_units(c, 3)
    got = await c.until("rate_limits.updated")
    return next(e for e in got if e["type"] == "response.created")["response"]["id"]


async def _ack(c, **fields) -> dict:  # noqa: ANN001, ANN003
    await c.send({"type": "playback.ack", **fields})
    return (await c.until("playback.acknowledged"))[-1]


async def test_acks_are_max_monotonic_and_clamped() -> None:
    async with session() as (c, rt):
        rid = await _spoken(c, rt)
        a1 = await _ack(c, response_id=rid, played_ms=1200)
        a2 = await _ack(c, response_id=rid, played_ms=500)  # lower: changes nothing (P-1)
        a3 = await _ack(c, item_id=f"item_{rid}", played_ms=99999, committed_ms=1000)  # clamped to sent_ms
        events = await close(c)
    assert a1["played_ms"] == 1200 and a1["committed_ms"] == 1200 and a1["history_committed"] is False
    assert a2["played_ms"] == 1200 and a2["playback"]["played_ms"] == 1200
    assert a3["played_ms"] == 1840 and a3["committed_ms"] == 1200
    assert a3["playback"] == {"generated_ms": 1840, "sent_ms": 1840, "played_ms": 1840, "committed_ms": 1200}
    assert a3["committed_text_chars"] == 26  # commit_all_on_done: final at response.done
    assert_conformant(events)


async def test_truncate_sets_heard_text_from_marks() -> None:
    async with session() as (c, rt):
        rid = await _spoken(c, rt)
        await c.send({"type": "conversation.item.truncate", "item_id": f"item_{rid}", "content_index": 0,
                      "audio_end_ms": 1500})
        tr = (await c.until("conversation.item.truncated"))[-1]
        await c.send({"type": "conversation.item.retrieve", "item_id": f"item_{rid}"})
        item = (await c.until("conversation.item.retrieved"))[-1]["item"]
        ack = await _ack(c, response_id=rid, played_ms=900, truncate=True)
        events = await close(c)
    assert tr["audio_end_ms"] == 1500
    # the last mark with audio_end_ms <= 1500 is (1000 ms, 10 chars): "Sure, one "
    assert item["content"][0]["transcript"] == "Sure, one "
    assert ack["played_ms"] == 900 and ack["committed_text_chars"] == 0 and ack["truncate"] is True
    assert_conformant(events)


async def test_cancelled_response_history_follows_acks() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Let me tell ", 1000)
        for u in range(2, 6):
            rt.plan[u] = Speak("you more ", 1000)
        await stream_units(c, 3)
        got = await c.until("response.output_audio_transcript.delta")
        got += await c.until("response.output_audio_transcript.delta")
        rid = next(e for e in got if e["type"] == "response.created")["response"]["id"]
        await _ack(c, response_id=rid, played_ms=1400)
        await c.send({"type": "response.cancel"})
        done = (await c.until("response.done"))[-1]["response"]
        later = await _ack(c, response_id=rid, played_ms=2000)  # P-4/§7.3: an open entry may still grow
        events = await close(c)
    assert done["duplex"]["committed"] == {"audio_ms": 1400, "text_chars": 12, "final": False}
    assert later["history_committed"] is True and later["committed_text_chars"] == 21
    assert_conformant(events)


async def test_ack_only_policy_commits_progressively() -> None:
    async with session(update={"playback_commit_policy": "ack_only"}) as (c, rt):
        rid = await _spoken(c, rt)
        a = await _ack(c, response_id=rid, played_ms=1000)
        b = await _ack(c, response_id=rid, played_ms=1840)
        events = await close(c)
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert done["duplex"]["committed"] == {"audio_ms": 0, "text_chars": 0, "final": False}
    assert (a["history_committed"], a["committed_text_chars"]) == (True, 10)
    assert (b["history_committed"], b["committed_text_chars"]) == (True, 26)
    assert_conformant(events)


async def test_item_create_retrieve_delete() -> None:
    async with session() as (c, rt):
        await c.send({"type": "conversation.item.create", "previous_item_id": None, "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": pcm16_b64(500, 24000)}]}})
        got = await c.until("conversation.item.done")
        item_id = got[-1]["item"]["id"]
        await c.send({"type": "conversation.item.retrieve", "item_id": item_id})
        ret = (await c.until("conversation.item.retrieved"))[-1]
        await c.send({"type": "conversation.item.delete", "item_id": item_id})
        deleted = (await c.until("conversation.item.deleted"))[-1]
        events = await close(c)
    assert ret["item"]["role"] == "user" and ret["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    assert deleted["item_id"] == item_id
    # 500 ms at 24 kHz resampled to 16 kHz and padded into unit 0
    assert rt.units_seen[0].unit_index == 0 and len(rt.units_seen[0].pcm) == 16480 * 4
    assert_conformant(events)


async def test_response_create_options_are_response_scoped() -> None:
    async with session() as (c, rt):
        await c.send(append(300))
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("conversation.item.done")
        await c.until("response.listen")  # the model declined the committed input
        rt.plan[1] = Speak("beep", 1000, end_of_turn=True)
        await c.send({"type": "response.create", "response": {
            "output_modalities": ["audio"], "audio": {"output": {"format": {"type": "audio/pcmu"}}},
            "metadata": {"topic": "demo"}, "extra_body": {"return_stage_metrics": False, "top_k": 3},
            "max_output_tokens": 50}})
        got = await c.until("rate_limits.updated", wait_s=4)
        await c.send({"type": "session.update", "session": {}})
        upd = (await c.until("session.updated"))[-1]
        events = await close(c)
    delta = next(e for e in got if e["type"] == "response.output_audio.delta")
    assert delta["format"] == "g711_ulaw" and delta["sample_rate_hz"] == 8000
    assert len(base64.b64decode(delta["delta"])) == 8000  # 1 s of G.711 at 8 kHz
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["metadata"] == {"topic": "demo"} and "stage_metrics" not in done["duplex"]
    assert upd["session"]["output_audio_format"] == "pcm16"  # the session config is untouched
    assert_conformant(events)


async def test_max_output_tokens_makes_response_incomplete() -> None:
    async with session(update={"max_output_tokens": 3}) as (c, rt):
        rt.plan[1] = Speak("abc", 1000, tokens=3)
        rt.plan[2] = Speak("never", 1000)
        await stream_units(c, 3)
        got = await c.until("rate_limits.updated")
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "incomplete" and done["status_details"] == {"type": "incomplete",
                                                                         "reason": "max_output_tokens"}
    assert "never" not in str(events)
    assert_conformant(events)
