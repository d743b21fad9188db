"""Conformance of whole runs (protocol.md §3.4-§3.8) through a real WebSocket and the fake runtime."""

from __future__ import annotations

import base64
import io

import pytest
import soundfile

from tests.gateway.fake_runtime import Listen, Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


async def test_spoken_response_run() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Sure, one ", 1000)
        rt.plan[2] = Speak("plus one is two.", 840, end_of_turn=True)
        await stream_units(c, 3)
        got = await c.until("rate_limits.updated")
        events = await close(c)
    assert_conformant(events)
    t = types(got)
    assert t.index("response.created") < t.index("response.speak") < t.index("response.output_audio.delta")
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "completed" and done["duplex"]["reason"] == "turn_end"
    assert done["output"][0]["content"][0]["transcript"] == "Sure, one plus one is two."
    assert done["duplex"]["committed"] == {"audio_ms": 1840, "text_chars": 26, "final": True}
    deltas = [e for e in got if e["type"] == "response.output_audio.delta"]
    assert [len(base64.b64decode(d["delta"])) for d in deltas] == [48000, 40320]
    assert deltas[-1]["metadata"]["end_of_turn"] is True
    sm = done["duplex"]["stage_metrics"]
    # two owned units with 3 tokens each (fake: 10 ms first token, 5 ms apart)
    assert sm["0"]["units"] == 2 and sm["0"]["num_generation_tokens"] == 6
    assert sm["0"]["ttft_ms"] == 10.0 and sm["0"]["tpot_ms"] == 5.0 and sm["0"]["itl_ms"]["count"] == 4
    assert sm["1"]["stage"] == "talker" and sm["2"]["stage"] == "code2wav"
    # the first owned unit's: from the stage's input, and from the unit's append (project addition, §10.1)
    assert (sm["1"]["first_output_ms"], sm["1"]["from_unit_ms"]) == (7.0, 40.0)
    assert (sm["2"]["first_output_ms"], sm["2"]["from_unit_ms"]) == (3.0, 45.0)
    # each owned unit's, in order (project addition, §10.1): stage0 from its unit_done (fake: 20 ms + the unit index)
    assert sm["0"]["from_unit_ms_by_unit"] == [21.0, 22.0]
    assert sm["1"]["from_unit_ms_by_unit"] == [40.0, 40.0] and sm["2"]["from_unit_ms_by_unit"] == [45.0, 45.0]


async def test_a_unit_of_several_token2wav_calls_sends_each_call_as_it_comes() -> None:
    """Issue 14 "audio as each Token2Wav call finishes": a piece flagged not-last leaves at once, with the
    unit's text; the last piece leaves at the unit's end with `end_of_turn`, its metrics and "" (C-3, C-4)."""
    async with session() as (c, rt):
        rt.plan[1] = Speak("Sure, one ", 1000, calls=True)
        rt.plan[2] = Speak("plus one is two.", 840, end_of_turn=True, calls=True)
        await stream_units(c, 3)
        got = await c.until("rate_limits.updated")
        events = await close(c)
    assert_conformant(events)
    deltas = [e for e in got if e["type"] == "response.output_audio.delta"]
    md = [d["metadata"] for d in deltas]
    assert [len(base64.b64decode(d["delta"])) for d in deltas] == [24000, 24000, 20160, 20160]
    assert [m["model_unit_index"] for m in md] == [1, 1, 2, 2]
    assert [m["end_of_turn"] for m in md] == [False, False, False, True]
    assert ["unit_metrics" in m for m in md] == [False, True, False, True]
    assert [(m["audio_start_ms"], m["audio_end_ms"]) for m in md] == [(0, 500), (500, 1000), (1000, 1420),
                                                                      (1420, 1840)]
    assert [m["audio_text_mark"]["text_chars"] for m in md] == [10, 10, 26, 26]
    text = [e["delta"] for e in got if e["type"] == "response.output_audio_transcript.delta"]
    halves = [got[i + 1]["delta"] for i, e in enumerate(got) if e["type"] == "response.output_audio.delta"]
    assert halves == ["", "", "", ""] and "".join(text) == "Sure, one plus one is two."  # the text went ahead
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["output"][0]["content"][0]["transcript"] == "Sure, one plus one is two."
    assert done["duplex"]["committed"] == {"audio_ms": 1840, "text_chars": 26, "final": True}


async def test_text_and_a_piece_not_last_leave_before_their_unit_ends() -> None:
    """Each text piece is on the socket as it comes, before any audio of its unit (P13); the not-last audio
    piece leaves while the runtime still works on the unit (no UnitDone yet)."""
    from gateway.runtime.base import AudioPiece, Decision, TextPiece, UnitDone
    from tests.gateway.fake_runtime import tone, unit_metrics

    async with session() as (c, rt):
        corr = next(iter(rt.seqs))
        rt.inject(corr, Decision(epoch=0, unit=0, action="speak"))
        rt.inject(corr, TextPiece(epoch=0, unit=0, text="Hi "))
        text = await c.until("response.output_audio_transcript.delta")
        assert text[-1]["delta"] == "Hi " and (await c.quiet(0.3)) == []
        rt.inject(corr, TextPiece(epoch=0, unit=0, text="there"))
        rt.inject(corr, AudioPiece(epoch=0, unit=0, seq=0, pcm16=tone(300), last=False))
        first = await c.until("response.output_audio.delta")
        first.append(await c.recv())
        assert (await c.quiet(0.3)) == []  # nothing else until the unit goes on
        rt.inject(corr, AudioPiece(epoch=0, unit=0, seq=1, pcm16=tone(200), last=True))
        assert (await c.quiet(0.3)) == []  # the last piece waits for the unit's end
        rt.inject(corr, UnitDone(epoch=0, unit=0, is_listen=False, end_of_turn=True, metrics=unit_metrics(2)))
        rest = await c.until("rate_limits.updated")
        events = await close(c)
    assert_conformant(events)
    assert [e["delta"] for e in first if e["type"] == "response.output_audio_transcript.delta"] == ["there", ""]
    delta = next(e for e in first if e["type"] == "response.output_audio.delta")
    assert len(base64.b64decode(delta["delta"])) == 14400 and delta["metadata"]["end_of_turn"] is False
    assert delta["metadata"]["audio_text_mark"]["text_chars"] == 8
    last = next(e for e in rest if e["type"] == "response.output_audio.delta")
    assert len(base64.b64decode(last["delta"])) == 9600 and last["metadata"]["end_of_turn"] is True
    assert [e["delta"] for e in rest if e["type"] == "response.output_audio_transcript.delta"] == [""]
    assert types(rest).index("response.output_audio.delta") < types(rest).index("response.done")


async def test_a_token2wav_call_without_audio_sends_no_delta() -> None:
    """A not-last piece with no samples (a Token2Wav call that returned none) leaves nothing: the first audio delta
    of the response carries the next piece's audio (e2e: the OpenAI SDK's first delta was empty, stop 29 CI)."""
    from gateway.runtime.base import AudioPiece, Decision, TextPiece, UnitDone
    from tests.gateway.fake_runtime import tone, unit_metrics

    async with session() as (c, rt):
        corr = next(iter(rt.seqs))
        rt.inject(corr, Decision(epoch=0, unit=0, action="speak"))
        rt.inject(corr, TextPiece(epoch=0, unit=0, text="Hi"))
        await c.until("response.output_audio_transcript.delta")
        rt.inject(corr, AudioPiece(epoch=0, unit=0, seq=0, pcm16=b"", last=False))
        assert (await c.quiet(0.3)) == []
        rt.inject(corr, AudioPiece(epoch=0, unit=0, seq=1, pcm16=tone(200), last=False))
        first = await c.until("response.output_audio.delta")
        rt.inject(corr, AudioPiece(epoch=0, unit=0, seq=2, pcm16=tone(100), last=True))
        rt.inject(corr, UnitDone(epoch=0, unit=0, is_listen=False, end_of_turn=True, metrics=unit_metrics(1)))
        rest = await c.until("rate_limits.updated")
        events = await close(c)
    assert_conformant(events)
    deltas = [first[-1]] + [e for e in rest if e["type"] == "response.output_audio.delta"]
    assert [len(base64.b64decode(d["delta"])) for d in deltas] == [9600, 4800]


def _pcm(delta: dict) -> bytes:
    """An audio delta's PCM16: the realtime `delta`, or the /v1/duplex pair's `audio` (a WAV, the native default)."""
    if "audio" not in delta:
        return base64.b64decode(delta["delta"])
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(delta["audio"])), dtype="int16")
    assert rate == 24000
    return samples.tobytes()


@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/duplex"])
async def test_a_speak_unit_without_audio_is_a_second_of_silence(path: str) -> None:
    """model.md §6.6: a speak unit the runtime renders no audio for (its first token ended it: no text rows, so no
    `tts_input` and no Token2Wav call) is 1 s of zeros, not an empty pair: as the response's first audio the client
    got zero bytes (e2e: the OpenAI SDK test's first delta, `audio_end_ms` 0). The pair keeps C-3, `end_of_turn`
    and the unit's metrics, the next unit's audio follows on the response's clock; /v1/duplex folds the same pair."""
    from gateway.runtime.base import AudioPiece, Decision, TextPiece, UnitDone
    from tests.gateway.fake_runtime import tone, unit_metrics

    native = path == "/v1/duplex"
    async with session(path=path, update={} if native else None) as (c, rt):
        corr = next(iter(rt.seqs))
        rt.inject(corr, Decision(epoch=0, unit=0, action="speak"))
        rt.inject(corr, UnitDone(epoch=0, unit=0, is_listen=False, end_of_turn=False, metrics=unit_metrics(1)))
        first = (await c.until("response.output_audio.delta"))[-1]  # unit 0's, before unit 1 exists
        rt.inject(corr, Decision(epoch=0, unit=1, action="speak"))
        rt.inject(corr, TextPiece(epoch=0, unit=1, text="Hi"))
        rt.inject(corr, AudioPiece(epoch=0, unit=1, seq=0, pcm16=tone(400), last=True))
        rt.inject(corr, UnitDone(epoch=0, unit=1, is_listen=False, end_of_turn=True, metrics=unit_metrics(1)))
        await c.until("response.done")
        events = await close(c)
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert deltas[0] == first and [len(_pcm(d)) for d in deltas] == [48000, 19200]
    assert not any(_pcm(first))
    md = [d if native else d["metadata"] for d in deltas]
    assert [(m["model_unit_index"], m["audio_start_ms"], m["audio_end_ms"], m["end_of_turn"]) for m in md] == [
        (0, 0, 1000, False), (1, 1000, 1400, True)]
    assert [m["audio_text_mark"] for m in md] == [{"text_chars": 0, "audio_end_ms": 1000},
                                                  {"text_chars": 2, "audio_end_ms": 1400}]
    done = next(e for e in events if e["type"] == "response.done")
    if native:
        assert [d["audio_transcript"] for d in deltas] == ["", "Hi"] and deltas[0]["model_speak"] is True
        assert done["status"] == "completed"
        return
    assert_conformant(events)
    assert all("unit_metrics" in m for m in md)
    pairs = [events[events.index(d) + 1] for d in deltas]
    assert [(p["type"], p["delta"]) for p in pairs] == [("response.output_audio_transcript.delta", "")] * 2
    assert done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Hi"


async def test_listen_only_run_has_no_response() -> None:
    async with session() as (c, rt):
        await stream_units(c, 3)
        got = [await c.recv() for _ in range(4)]  # speech_started + 3 listens
        events = await close(c)
    assert_conformant(events)
    listens = [e for e in got if e["type"] == "response.listen"]
    assert [e["model_unit_index"] for e in listens] == [0, 1, 2]
    assert all(e["response_id"] is None and e["response"]["metadata"]["reason"] == "model_listen" for e in listens)
    assert "response.created" not in types(events)


async def test_precreated_response_declined_by_listen() -> None:
    async with session(update={"extra_body": {"auto_response": False}}) as (c, rt):
        await stream_units(c, 1)
        await c.until("response.listen")
        await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(3200)).decode(),
                      "sample_rate_hz": 16000})
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"metadata": {"topic": "demo"}}})
        got = await c.until("rate_limits.updated", wait_s=5)
        events = await close(c)
    assert_conformant(events)
    listen = next(e for e in got if e["type"] == "response.listen" and e["response_id"])
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert listen["response"]["id"] == done["id"]
    assert done["status"] == "completed" and done["duplex"]["reason"] == "model_listen"
    assert done["duplex"]["decision"] == "listen" and done["metadata"] == {"topic": "demo"}
    assert "response.speak" not in types(got)
    # U-7: with auto_response off units are forced to listen until response.create releases the hold
    forced = [op[1][2] for op in rt.ops if op[0] == "append"]
    assert forced[0] is True and forced[-1] is False


async def test_cancel_mid_response() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Let me tell you ", 1000)
        for u in range(2, 6):
            rt.plan[u] = Speak("more ", 1000)
        await stream_units(c, 2)
        await c.until("response.output_audio_transcript.delta")
        await c.send({"type": "response.cancel", "event_id": "c-77"})
        got = await c.until("rate_limits.updated")
        # audio keeps flowing; the next unit is force-listened by the runtime (F-5), then a new turn opens
        await stream_units_more(c, 2)
        later = await c.until("response.speak")
        events = await close(c)
    assert_conformant(events)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled" and done["status_details"] == {"type": "cancelled",
                                                                         "reason": "client_cancelled"}
    assert done["duplex"]["reason"] == "client_cancelled"
    new = next(e for e in later if e["type"] == "response.created")["response"]
    assert new["id"] != done["id"] and new["duplex"]["epoch"] == 1
    assert new["duplex"]["model_turn_id"] == done["duplex"]["model_turn_id"] + 1
    cancels = [op for op in rt.ops if op[0] == "cancel"]
    assert len(cancels) == 1 and cancels[0][1][0].epoch == 0 and cancels[0][1][1].epoch == 1


async def stream_units_more(c, units: int) -> None:  # noqa: ANN001
    from tests.gateway.harness import append

    for _ in range(units * 5):
        await c.send(append(200))


async def test_text_only_run() -> None:
    async with session(update={"output_modalities": ["text"]}) as (c, rt):
        rt.plan[1] = Speak("Hi ", 0)
        rt.plan[2] = Speak("there.", 0, end_of_turn=True)
        await stream_units(c, 3)
        got = await c.until("rate_limits.updated")
        events = await close(c)
    assert_conformant(events)
    t = types(got)
    # one text delta per text piece as it comes (3 per unit in the fake), not one per unit (P13)
    assert "response.output_audio.delta" not in t and t.count("response.output_text.delta") == 6
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["output_modalities"] == ["text"] and "1" not in done["duplex"]["stage_metrics"]
    assert next(e for e in got if e["type"] == "response.output_text.done")["text"] == "Hi there."


async def test_listen_end_of_turn_completes_response_first() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Done", 500)
        rt.plan[2] = Listen(end_of_turn=True)
        await stream_units(c, 3)
        got = await c.until("response.listen", wait_s=5)
        got += await c.until("response.listen")
        events = await close(c)
    assert_conformant(events)
    t = types(got)
    assert t.index("rate_limits.updated") < len(t) - 1
    last = got[-1]
    assert last["response"]["metadata"]["reason"] == "empty_turn_end" and last["response_id"] is None


async def test_precreated_response_speaks_its_whole_turn_with_auto_response_off() -> None:
    async with session(update={"extra_body": {"auto_response": False}}) as (c, rt):
        await c.send(append(300))
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("response.listen")  # unit 0: forced listen (hold)
        rt.plan[1] = Speak("One ", 1000)
        rt.plan[2] = Speak("two.", 800, end_of_turn=True)
        await c.send({"type": "response.create"})
        got = await c.until("rate_limits.updated", wait_s=5)
        await c.send(append(1000))
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("response.listen")  # hold again once the response is over
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["output"][0]["content"][0]["transcript"] == "One two." and done["duplex"]["reason"] == "turn_end"
    assert [u.force_listen for u in rt.units_seen] == [True, False, False, True]
    assert_conformant(events)


async def test_a_units_audio_marks_only_the_text_up_to_it_when_the_next_units_text_went_ahead() -> None:
    """§7.5 with P13: unit 1's text is out before unit 0's audio; unit 0's mark counts unit 0's text only."""
    from gateway.runtime.base import AudioPiece, Decision, TextPiece, UnitDone
    from tests.gateway.fake_runtime import tone, unit_metrics

    async with session() as (c, rt):
        corr = next(iter(rt.seqs))
        for ev in (Decision(epoch=0, unit=0, action="speak"), TextPiece(epoch=0, unit=0, text="ab"),
                   Decision(epoch=0, unit=1, action="speak"), TextPiece(epoch=0, unit=1, text="cde"),
                   AudioPiece(epoch=0, unit=0, seq=0, pcm16=tone(100)),
                   UnitDone(epoch=0, unit=0, is_listen=False, end_of_turn=False, metrics=unit_metrics(1)),
                   AudioPiece(epoch=0, unit=1, seq=0, pcm16=tone(100)),
                   UnitDone(epoch=0, unit=1, is_listen=False, end_of_turn=True, metrics=unit_metrics(1))):
            rt.inject(corr, ev)
        got = await c.until("rate_limits.updated")
        # the history heard up to unit 0's audio end holds unit 0's text, not unit 1's sent ahead of it
        rid = next(e for e in got if e["type"] == "response.done")["response"]["id"]
        await c.send({"type": "conversation.item.truncate", "item_id": f"item_{rid}", "content_index": 0,
                      "audio_end_ms": 100})
        await c.until("conversation.item.truncated")
        await c.send({"type": "conversation.item.retrieve", "item_id": f"item_{rid}"})
        item = (await c.until("conversation.item.retrieved"))[-1]["item"]
        events = await close(c)
    assert_conformant(events)
    assert item["content"][0]["transcript"] == "ab"
    marks = [e["metadata"]["audio_text_mark"] for e in got if e["type"] == "response.output_audio.delta"]
    assert [m["text_chars"] for m in marks] == [2, 5]
    text = [e["delta"] for e in got if e["type"] == "response.output_audio_transcript.delta"]
    assert text == ["ab", "cde", "", ""]
