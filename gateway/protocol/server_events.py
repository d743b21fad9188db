"""Server -> client events (protocol.md §3.2) in the canonical `ga` vocabulary.

One closed, typed set: each model pins its `type` with a Literal and `ServerEvent` is the
discriminated union. The session builds these; `gateway.protocol.profiles` renames them for the
`beta` and `native` profiles at send time. Extension keys ride in `metadata`/`duplex`, so the
OpenAI-defined fields keep OpenAI's types (§3.11 OA-1).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Json = dict[str, Any]


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class SessionCreated(_Out):
    type: Literal["session.created"] = "session.created"
    session: Json
    incarnation: int
    attachment_generation: int


class SessionUpdated(_Out):
    type: Literal["session.updated"] = "session.updated"
    session: Json


class SessionClosed(_Out):
    type: Literal["session.closed"] = "session.closed"
    session_id: str
    epoch: int
    reason: str
    client_reason: str | None = None
    cleanup_pending: bool = False


class SessionExpired(_Out):
    type: Literal["session.expired"] = "session.expired"
    session_id: str
    epoch: int
    reason: str


class HeartbeatAck(_Out):
    type: Literal["session.heartbeat_ack"] = "session.heartbeat_ack"
    session_id: str
    lease_expires_in_s: float | None


class SpeechStarted(_Out):
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    item_id: str
    audio_start_ms: int
    metadata: Json


class SpeechStopped(_Out):
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    item_id: str
    audio_end_ms: int
    metadata: Json


class InputCommitted(_Out):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None
    metadata: Json


class InputCleared(_Out):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"
    metadata: Json


class ItemAdded(_Out):
    type: Literal["conversation.item.added"] = "conversation.item.added"
    previous_item_id: str | None
    item: Json


class ItemDone(_Out):
    type: Literal["conversation.item.done"] = "conversation.item.done"
    previous_item_id: str | None
    item: Json


class TranscriptionCompleted(_Out):
    type: Literal["conversation.item.input_audio_transcription.completed"] = (
        "conversation.item.input_audio_transcription.completed")
    item_id: str
    content_index: int = 0
    transcript: str = ""
    usage: Json


class ItemRetrieved(_Out):
    type: Literal["conversation.item.retrieved"] = "conversation.item.retrieved"
    item: Json


class ItemDeleted(_Out):
    type: Literal["conversation.item.deleted"] = "conversation.item.deleted"
    item_id: str


class ItemTruncated(_Out):
    type: Literal["conversation.item.truncated"] = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


class ResponseCreated(_Out):
    type: Literal["response.created"] = "response.created"
    response: Json


class ResponseDone(_Out):
    type: Literal["response.done"] = "response.done"
    response: Json


class RateLimitsUpdated(_Out):
    type: Literal["rate_limits.updated"] = "rate_limits.updated"
    rate_limits: list[Json] = Field(default_factory=list)


class _ItemRef(_Out):
    response_id: str
    output_index: int = 0


class _PartRef(_ItemRef):
    item_id: str
    content_index: int = 0


class OutputItemAdded(_ItemRef):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    item: Json


class OutputItemDone(_ItemRef):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    item: Json


class ContentPartAdded(_PartRef):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    part: Json


class ContentPartDone(_PartRef):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    part: Json


class ResponseSpeak(_PartRef):
    type: Literal["response.speak"] = "response.speak"
    session_id: str
    epoch: int
    model_turn_id: int
    model_unit_index: int | None


class AudioDelta(_PartRef):
    type: Literal["response.output_audio.delta"] = "response.output_audio.delta"
    delta: str
    format: str
    sample_rate_hz: int
    metadata: Json


class TranscriptDelta(_PartRef):
    type: Literal["response.output_audio_transcript.delta"] = "response.output_audio_transcript.delta"
    delta: str
    metadata: Json


class TextDelta(_PartRef):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    metadata: Json


class AudioDone(_PartRef):
    type: Literal["response.output_audio.done"] = "response.output_audio.done"


class TranscriptDone(_PartRef):
    type: Literal["response.output_audio_transcript.done"] = "response.output_audio_transcript.done"
    transcript: str


class TextDone(_PartRef):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str


class ResponseListen(_Out):
    type: Literal["response.listen"] = "response.listen"
    session_id: str
    epoch: int
    model_turn_id: int
    model_unit_index: int | None
    response_id: str | None
    response: Json


class OutputCleared(_Out):
    type: Literal["output_audio_buffer.cleared"] = "output_audio_buffer.cleared"
    response_id: str


class PlaybackAcknowledged(_Out):
    type: Literal["playback.acknowledged"] = "playback.acknowledged"
    session_id: str
    epoch: int
    response_id: str
    item_id: str
    played_ms: int
    committed_ms: int
    truncate: bool
    playback: Json
    history_committed: bool
    committed_text_chars: int


class OverlapDecision(_Out):
    type: Literal["overlap.decision"] = "overlap.decision"
    session_id: str
    epoch: int
    response_id: str | None
    policy: str
    action: str
    reason: str
    metadata: Json


class TurnEvent(_Out):
    type: Literal["turn.event"] = "turn.event"
    session_id: str
    epoch: int
    event: str
    turn_state: str


class ErrorEvent(_Out):
    """Canonical (nested) error; `profiles` flattens it for `/v1/duplex`."""
    type: Literal["error"] = "error"
    error: Json


ServerEvent = Annotated[
    SessionCreated | SessionUpdated | SessionClosed | SessionExpired | HeartbeatAck | SpeechStarted | SpeechStopped
    | InputCommitted | InputCleared | ItemAdded | ItemDone | TranscriptionCompleted | ItemRetrieved
    | ItemDeleted | ItemTruncated | ResponseCreated | ResponseDone | RateLimitsUpdated | OutputItemAdded
    | OutputItemDone | ContentPartAdded | ContentPartDone | ResponseSpeak | AudioDelta | TranscriptDelta
    | TextDelta | AudioDone | TranscriptDone | TextDone | ResponseListen | OutputCleared
    | PlaybackAcknowledged | OverlapDecision | TurnEvent | ErrorEvent,
    Field(discriminator="type"),
]
SERVER_EVENT_ADAPTER: TypeAdapter[ServerEvent] = TypeAdapter(ServerEvent)

# §1.4: attachment-control events and frame rejections carry no server_event_seq.
UNSEQUENCED_TYPES: frozenset[str] = frozenset({
    "session.created", "session.resumed", "session.replaced", "session.resync_required",
    "session.heartbeat_ack",
})
