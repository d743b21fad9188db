"""Event-name map of protocol.md §3.3: canonical `ga` events -> `beta` / `native` vocabularies.

The projector runs inside the writer at send time. It is stateful only for the native audio
delta, which folds `response.speak` into `model_speak` and the transcript half of a pair into
the audio event.
"""

from __future__ import annotations

import enum
from typing import Any

Json = dict[str, Any]


class Profile(enum.StrEnum):
    GA = "ga"
    BETA = "beta"
    NATIVE = "native"


BETA_NAMES: dict[str, str] = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
_BETA_CONTENT = {"output_audio": "audio", "output_text": "text"}

# Realtime events the native dialect folds into others or does not emit (§3.3 "(not emitted)").
_NATIVE_DROPPED: frozenset[str] = frozenset({
    "response.speak", "response.output_audio.done", "response.output_audio_transcript.done",
    "response.output_text.done", "conversation.item.added", "conversation.item.done",
    "response.output_item.added", "response.output_item.done", "response.content_part.added",
    "response.content_part.done", "rate_limits.updated", "conversation.item.input_audio_transcription.completed",
})
_NATIVE_RENAMES: dict[str, str] = {
    "input_audio_buffer.speech_started": "input.speech_started",
    "input_audio_buffer.speech_stopped": "input.speech_stopped",
}


def _beta_item(item: Json) -> Json:
    content = [dict(c, type=_BETA_CONTENT.get(c.get("type"), c.get("type"))) for c in item.get("content", [])]
    return dict(item, content=content)


def _flat_error(ev: Json) -> Json:
    err = ev["error"]
    out = {"type": "error", "event_id": ev.get("event_id"), "error": err["message"], "code": err["code"],
           "error_type": err["type"], "retryable": err["retryable"], "param": err["param"],
           "client_event_id": err["event_id"]}
    if "server_event_seq" in ev:
        out["server_event_seq"] = ev["server_event_seq"]
    return out


class Projector:
    """Projects canonical event dicts (without envelope) into one profile."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._speak_pending: set[str] = set()
        self._pending_audio: Json | None = None

    def project(self, ev: Json) -> Json | None:
        if self.profile is Profile.GA:
            return ev
        if self.profile is Profile.BETA:
            return self._beta(ev)
        return self._native(ev)

    def _beta(self, ev: Json) -> Json:
        out = dict(ev, type=BETA_NAMES.get(ev["type"], ev["type"]))
        if "item" in out and isinstance(out["item"], dict):
            out["item"] = _beta_item(out["item"])
        if out["type"] == "response.done":
            out["response"] = dict(out["response"], output=[_beta_item(i) for i in out["response"]["output"]])
        return out

    def _native(self, ev: Json) -> Json | None:
        name = ev["type"]
        if name == "response.speak":
            self._speak_pending.add(ev["response_id"])
        if name in _NATIVE_DROPPED:
            return None
        if name == "error":
            return _flat_error(ev)
        if name in _NATIVE_RENAMES:
            return dict(ev, type=_NATIVE_RENAMES[name])
        handler = _NATIVE_HANDLERS.get(name)
        return handler(self, ev) if handler else ev

    def _audio_delta(self, ev: Json) -> None:
        self._pending_audio = ev
        return None

    def _transcript_delta(self, ev: Json) -> Json:
        audio, self._pending_audio = self._pending_audio or {}, None
        md = audio.get("metadata", {})
        rid = ev["response_id"]
        out = {"type": "response.output_audio.delta", "response_id": rid, "epoch": md.get("epoch"),
               "model_turn_id": md.get("model_turn_id"), "model_unit_index": md.get("model_unit_index"),
               "audio": audio.get("delta", ""), "audio_transcript": ev["delta"], "format": audio.get("format"),
               "sample_rate_hz": audio.get("sample_rate_hz"), "end_of_turn": md.get("end_of_turn"),
               "audio_start_ms": md.get("audio_start_ms"), "audio_end_ms": md.get("audio_end_ms"),
               "audio_text_mark": md.get("audio_text_mark"), "model_speak": rid in self._speak_pending}
        self._speak_pending.discard(rid)
        return out

    def _text_delta(self, ev: Json) -> Json:
        self._speak_pending.discard(ev["response_id"])
        return dict(ev, type="response.text.delta")

    def _response_created(self, ev: Json) -> Json:
        r = ev["response"]
        d = r["duplex"]
        return {"type": "response.created", "response_id": r["id"], "epoch": d["epoch"],
                "model_turn_id": d["model_turn_id"], "trigger": d["trigger"],
                "input_item_id": d["input_item_id"], "metadata": r["metadata"]}

    def _response_done(self, ev: Json) -> Json:
        r = ev["response"]
        d = r["duplex"]
        content = r["output"][0]["content"][0] if r["output"] and r["output"][0]["content"] else {}
        transcript = content.get("transcript") or ""
        text = content.get("text") or ""
        self._speak_pending.discard(r["id"])
        if r["status"] == "cancelled":
            return {"type": "audio.cancelled", "response_id": r["id"], "epoch": d["epoch"],
                    "reason": d["reason"], "transcript": transcript or text, "playback": d.get("playback"),
                    "committed": d.get("committed"), "duplex": d}
        return {"type": "response.done", "response_id": r["id"], "epoch": d["epoch"], "status": r["status"],
                "status_details": r["status_details"], "transcript": transcript, "text": text,
                "metadata": r["metadata"], "duplex": d}

    def _output_cleared(self, ev: Json) -> Json:
        return {"type": "output.cleared", "response_id": ev["response_id"]}

    def _committed(self, ev: Json) -> Json:
        return dict({"type": "input.committed", "item_id": ev["item_id"],
                     "previous_item_id": ev["previous_item_id"]}, **ev["metadata"])

    def _cleared(self, ev: Json) -> Json:
        md = ev["metadata"]
        return {"type": "input.cancelled", "epoch": md["epoch"], "item_id": md["item_id"], "reason": md["reason"]}


_NATIVE_HANDLERS = {
    "response.output_audio.delta": Projector._audio_delta,
    "response.output_audio_transcript.delta": Projector._transcript_delta,
    "response.output_text.delta": Projector._text_delta,
    "response.created": Projector._response_created,
    "response.done": Projector._response_done,
    "output_audio_buffer.cleared": Projector._output_cleared,
    "input_audio_buffer.committed": Projector._committed,
    "input_audio_buffer.cleared": Projector._cleared,
}
