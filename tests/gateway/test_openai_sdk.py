"""OA-1: every OpenAI-defined event the `ga` profile emits validates against the OpenAI SDK's GA models;
extension events are left to the SDK's tolerant path (OA-3)."""

from __future__ import annotations

import typing

import pytest
from pydantic import TypeAdapter, ValidationError

from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append
from tests.gateway.scenario import close, session, stream_units

realtime = pytest.importorskip("openai.types.realtime")
ADAPTER = TypeAdapter(realtime.RealtimeServerEvent)


def _known_types() -> set[str]:
    union = typing.get_args(realtime.RealtimeServerEvent)[0]
    out = set()
    for model in typing.get_args(union):
        field = model.model_fields.get("type")
        if field is not None:
            out |= set(typing.get_args(field.annotation))
    return out


async def test_ga_events_validate_against_sdk_models() -> None:
    async with session(update={"input_audio_transcription": {"model": "none"}}) as (c, rt):
        rt.plan[1] = Speak("Sure, one ", 1000)
        rt.plan[2] = Speak("plus one is two.", 840, end_of_turn=True)
        rt.plan[4] = Speak("again ", 1000)
        rt.plan[5] = Speak("and again ", 1000)
        await stream_units(c, 3)
        await c.until("rate_limits.updated")
        await c.send(append(300))
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("conversation.item.done")
        for _ in range(10):
            await c.send(append(200))
        await c.until("response.output_audio_transcript.delta")
        await c.send({"type": "output_audio_buffer.clear"})
        await c.until("rate_limits.updated")
        await c.send({"type": "conversation.item.retrieve", "item_id": "item_missing"})
        await c.until("error")
        events = await close(c)
    known = _known_types()
    checked = set()
    for ev in events:
        if ev["type"] not in known:
            continue
        try:
            ADAPTER.validate_python(ev)
        except ValidationError as exc:  # pragma: no cover - the message is the useful part
            raise AssertionError(f"{ev['type']} does not validate: {exc}") from None
        checked.add(ev["type"])
    assert {"session.created", "session.updated", "response.created", "response.done",
            "response.output_audio.delta", "response.output_audio_transcript.delta", "rate_limits.updated",
            "conversation.item.added", "output_audio_buffer.cleared", "input_audio_buffer.committed",
            "conversation.item.input_audio_transcription.completed", "error"} <= checked
