"""Typed server events (protocol.md §3.2) and the one parser that builds them from wire JSON.

Every event keeps its envelope (`event_id`, `seq` = `server_event_seq`) and the raw object, so nothing the
server sent is lost. Beta and native names (§3.3) are normalised to the `ga` names, so one client serves
`/v1/realtime` and `/v1/duplex`: the native audio delta carries its transcript (`AudioDelta.transcript`), and
the native cancel terminal `audio.cancelled` becomes `ResponseDone(status="cancelled")`. Events this client
does not model become `OtherEvent`, dispatched on `type` like every other (OA-3).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from clients.audio import decode_audio_payload

BETA_TO_GA = {
    "response.audio.delta": "response.output_audio.delta",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    "conversation.item.created": "conversation.item.added",
}
NATIVE_TO_GA = {
    "output.cleared": "output_audio_buffer.cleared",
    "input.committed": "input_audio_buffer.committed",
    "input.cancelled": "input_audio_buffer.cleared",
    "input.speech_started": "input_audio_buffer.speech_started",
    "input.speech_stopped": "input_audio_buffer.speech_stopped",
    "audio.cancelled": "response.done",
}


@dataclass(frozen=True, kw_only=True)
class ServerEvent:
    type: str
    event_id: str | None = None
    seq: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class SessionCreated(ServerEvent):
    type: Literal["session.created", "session.resumed"] = "session.created"
    session_id: str
    resume_token: str | None
    incarnation: int | None
    attachment_generation: int
    session: Mapping[str, Any]
    replay_count: int = 0


@dataclass(frozen=True, kw_only=True)
class ResponseCreated(ServerEvent):
    type: Literal["response.created"] = "response.created"
    response_id: str
    trigger: str | None
    epoch: int | None


@dataclass(frozen=True, kw_only=True)
class AudioDelta(ServerEvent):
    type: Literal["response.output_audio.delta"] = "response.output_audio.delta"
    response_id: str
    pcm16: bytes = field(repr=False)  # decoded to PCM16 LE mono whatever the wire format
    sample_rate_hz: int
    metadata: Mapping[str, Any]
    transcript: str | None = None  # native profile only: the unit's text rides on the audio delta

    @property
    def duration_ms(self) -> float:
        # §9.3: derive the chunk duration from the decoded length, never assume 1000 ms
        return len(self.pcm16) / 2 / self.sample_rate_hz * 1000.0


@dataclass(frozen=True, kw_only=True)
class TextDelta(ServerEvent):
    type: Literal["response.output_audio_transcript.delta", "response.output_text.delta"]
    response_id: str
    delta: str


@dataclass(frozen=True, kw_only=True)
class ResponseDone(ServerEvent):
    type: Literal["response.done"] = "response.done"
    response_id: str
    status: str
    reason: str | None  # response.duplex.reason (the detailed one; status_details holds OpenAI's values)
    transcript: str
    duplex: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class ResponseListen(ServerEvent):
    type: Literal["response.listen"] = "response.listen"
    response_id: str | None
    reason: str | None
    model_unit_index: int | None


@dataclass(frozen=True, kw_only=True)
class ResponseScoped(ServerEvent):
    """`response.speak`, `output_audio_buffer.cleared`, `response.output_audio.done`, ... (id only)."""
    response_id: str | None


@dataclass(frozen=True, kw_only=True)
class PlaybackAcknowledged(ServerEvent):
    type: Literal["playback.acknowledged"] = "playback.acknowledged"
    response_id: str
    played_ms: int
    committed_ms: int
    history_committed: bool


@dataclass(frozen=True, kw_only=True)
class InputCommitted(ServerEvent):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    no_response: bool
    deferred: bool


@dataclass(frozen=True, kw_only=True)
class ErrorEvent(ServerEvent):
    """Both error shapes of §1.6 (nested on /v1/realtime, flat on /v1/duplex) in one type."""
    type: Literal["error"] = "error"
    code: str
    message: str
    error_type: str
    retryable: bool
    param: str | None
    client_event_id: str | None


@dataclass(frozen=True, kw_only=True)
class SessionEnded(ServerEvent):
    type: Literal["session.closed", "session.expired", "session.replaced", "session.resync_required"]
    session_id: str | None
    reason: str | None


@dataclass(frozen=True, kw_only=True)
class HeartbeatAck(ServerEvent):
    type: Literal["session.heartbeat_ack"] = "session.heartbeat_ack"
    lease_expires_in_s: float | None


@dataclass(frozen=True, kw_only=True)
class OtherEvent(ServerEvent):
    pass


def _env(raw: Mapping[str, Any], type_: str) -> dict[str, Any]:
    return {"type": type_, "event_id": raw.get("event_id"), "seq": raw.get("server_event_seq"), "raw": raw}


def _session_created(raw: Mapping[str, Any], e: dict[str, Any]) -> ServerEvent:
    session = raw.get("session") or {}
    return SessionCreated(**e, session_id=raw.get("session_id") or session.get("id", ""),
                          resume_token=raw.get("resume_token"), incarnation=raw.get("incarnation"),
                          attachment_generation=int(raw.get("attachment_generation") or 1), session=session,
                          replay_count=int(raw.get("replay_count") or 0))


def _audio_delta(raw: Mapping[str, Any], e: dict[str, Any]) -> ServerEvent:
    native = "audio" in raw and "delta" not in raw
    fmt = str(raw.get("format") or "pcm16")
    rate = int(raw.get("sample_rate_hz") or 24000)
    payload = raw.get("audio") if native else raw.get("delta")
    pcm, rate = decode_audio_payload(base64.b64decode(payload or ""), fmt, rate)
    metadata = raw if native else raw.get("metadata") or {}
    return AudioDelta(**e, response_id=raw["response_id"], pcm16=pcm, sample_rate_hz=rate, metadata=metadata,
                      transcript=str(raw.get("audio_transcript") or "") if native else None)


def _response_created(raw: Mapping[str, Any], e: dict[str, Any]) -> ServerEvent:
    if "response" not in raw:  # native: flat fields
        return ResponseCreated(**e, response_id=raw["response_id"], trigger=raw.get("trigger"),
                               epoch=raw.get("epoch"))
    duplex = raw["response"].get("duplex") or {}
    return ResponseCreated(**e, response_id=raw["response"]["id"], trigger=duplex.get("trigger"),
                           epoch=duplex.get("epoch"))


def _response_done(raw: Mapping[str, Any], e: dict[str, Any]) -> ServerEvent:
    if raw.get("type") == "audio.cancelled":  # native cancel terminal (§3.3)
        return ResponseDone(**e, response_id=raw["response_id"], status="cancelled", reason=raw.get("reason"),
                            transcript=str(raw.get("transcript") or ""), duplex=raw)
    if "response" not in raw:  # native response.done
        duplex = raw.get("duplex") or {}
        return ResponseDone(**e, response_id=raw["response_id"], status=str(raw.get("status", "")),
                            reason=duplex.get("reason"), duplex=duplex,
                            transcript=str(raw.get("transcript") or raw.get("text") or ""))
    resp = raw["response"]
    duplex = resp.get("duplex") or {}
    parts = [c for item in resp.get("output") or [] for c in item.get("content") or []]
    transcript = "".join(str(c.get("transcript") or c.get("text") or "") for c in parts)
    return ResponseDone(**e, response_id=resp.get("id", ""), status=resp.get("status", ""),
                        reason=duplex.get("reason"), transcript=transcript, duplex=duplex)


def _error(raw: Mapping[str, Any], e: dict[str, Any]) -> ServerEvent:
    err = raw.get("error")
    if isinstance(err, Mapping):  # the nested shape of /v1/realtime (§1.6)
        return ErrorEvent(**e, code=str(err.get("code") or ""), message=str(err.get("message") or ""),
                          error_type=str(err.get("type") or "invalid_request_error"),
                          retryable=bool(err.get("retryable")), param=err.get("param"),
                          client_event_id=err.get("event_id"))
    return ErrorEvent(**e, code=str(raw.get("code") or ""), message=str(err or ""),
                      error_type=str(raw.get("error_type") or "invalid_request_error"),
                      retryable=bool(raw.get("retryable")), param=raw.get("param"),
                      client_event_id=raw.get("client_event_id"))


_BUILDERS: dict[str, Callable[[Mapping[str, Any], dict[str, Any]], ServerEvent]] = {
    "session.created": _session_created,
    "session.resumed": _session_created,
    "response.created": _response_created,
    "response.output_audio.delta": _audio_delta,
    "response.output_audio_transcript.delta": lambda r, e: TextDelta(
        **e, response_id=r["response_id"], delta=str(r.get("delta") or "")),
    "response.output_text.delta": lambda r, e: TextDelta(
        **e, response_id=r["response_id"], delta=str(r.get("delta") or "")),
    "response.done": _response_done,
    "response.listen": lambda r, e: ResponseListen(
        **e, response_id=r.get("response_id"), reason=((r.get("response") or {}).get("metadata") or {}).get(
            "reason"), model_unit_index=r.get("model_unit_index")),
    "playback.acknowledged": lambda r, e: PlaybackAcknowledged(
        **e, response_id=r["response_id"], played_ms=int(r.get("played_ms") or 0),
        committed_ms=int(r.get("committed_ms") or 0), history_committed=bool(r.get("history_committed"))),
    "input_audio_buffer.committed": lambda r, e: InputCommitted(
        **e, item_id=r.get("item_id", ""), no_response=bool((r.get("metadata") or r).get("no_response")),
        deferred=bool((r.get("metadata") or r).get("response_create_deferred"))),
    "error": _error,
    "session.heartbeat_ack": lambda r, e: HeartbeatAck(**e, lease_expires_in_s=r.get("lease_expires_in_s")),
}
for _name in ("session.closed", "session.expired", "session.replaced", "session.resync_required"):
    _BUILDERS[_name] = lambda r, e: SessionEnded(**e, session_id=r.get("session_id"), reason=r.get("reason"))
for _name in ("response.speak", "output_audio_buffer.cleared", "response.output_audio.done",
              "response.output_audio_transcript.done", "response.output_text.done"):
    _BUILDERS[_name] = lambda r, e: ResponseScoped(**e, response_id=r.get("response_id"))


def parse_event(raw: Mapping[str, Any]) -> ServerEvent:
    """Build the typed event for one decoded server frame (raises KeyError/ValueError on a malformed one)."""
    type_ = str(raw.get("type", ""))
    type_ = BETA_TO_GA.get(type_) or NATIVE_TO_GA.get(type_) or type_
    builder = _BUILDERS.get(type_)
    envelope = _env(raw, type_)
    return builder(raw, envelope) if builder is not None else OtherEvent(**envelope)
