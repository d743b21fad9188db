"""Client -> server events (protocol.md §3.1): one closed, typed set with a `type` discriminator.

Aliases are rewritten to canonical names by `normalise_type` before an event is admitted to the
mailbox (§1.3); the rest of the gateway sees canonical names only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Event(BaseModel):
    # Unknown fields on a known event are ignored (§1.3); strict so "1" never passes as an int.
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: dict[str, Any] = Field(default_factory=dict)


class SessionCreate(_Event):
    type: Literal["session.create"]
    session: dict[str, Any] | None = None


class SessionResume(_Event):
    type: Literal["session.resume"]


class SessionHeartbeat(_Event):
    type: Literal["session.heartbeat"]


class SessionEventAck(_Event):
    type: Literal["session.event_ack"]
    server_event_seq: Any = None  # validated by the session: invalid_event_ack, not bad_event


class SessionClose(_Event):
    type: Literal["session.close"]
    reason: str | None = None


class InputAudioBufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str = ""
    format: str | None = None
    input_audio_format: str | None = None
    sample_rate_hz: int | None = None
    duration_ms: float | None = None
    audio_end_ms: float | None = None
    is_speech: bool | None = None
    video_frames: list[str] | None = None
    max_slice_nums: Annotated[int, Field(ge=1, le=9)] = 1
    final: bool = False
    force_listen: bool = False
    overlap_action: str | None = None
    force_barge_in: bool = False


class InputAudioBufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]
    final: bool = True
    response_create: bool | None = None
    is_speech: bool | None = None


class InputAudioBufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class InputCancel(_Event):
    type: Literal["input.cancel"]


class InputTextAppend(_Event):
    type: Literal["input.text.append"]
    text: str | None = None


class ConversationItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: dict[str, Any]
    previous_item_id: str | None = None


class ConversationItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str | None = None


class ConversationItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str | None = None


class ConversationItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str | None = None
    content_index: Literal[0] = 0
    audio_end_ms: Annotated[int, Field(ge=0)]


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: dict[str, Any] | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


class OutputAudioBufferClear(_Event):
    type: Literal["output_audio_buffer.clear"]


class BargeIn(_Event):
    type: Literal["barge_in"]
    source: str | None = None


class TurnSignal(_Event):
    type: Literal["turn.signal"]
    event: str
    payload: dict[str, Any] = Field(default_factory=dict)


class PlaybackAck(_Event):
    type: Literal["playback.ack"]
    response_id: str | None = None
    item_id: str | None = None
    played_ms: Annotated[int, Field(ge=0)]
    committed_ms: Annotated[int, Field(ge=0)] | None = None
    truncate: bool = False


ClientEvent = Annotated[
    SessionUpdate | SessionCreate | SessionResume | SessionHeartbeat | SessionEventAck | SessionClose
    | InputAudioBufferAppend | InputAudioBufferCommit | InputAudioBufferClear | InputCancel | InputTextAppend
    | ConversationItemCreate | ConversationItemRetrieve | ConversationItemDelete | ConversationItemTruncate
    | ResponseCreate | ResponseCancel | OutputAudioBufferClear | BargeIn | TurnSignal | PlaybackAck,
    Field(discriminator="type"),
]
CLIENT_EVENT_ADAPTER: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)

CANONICAL_TYPES: frozenset[str] = frozenset(
    m.model_fields["type"].annotation.__args__[0]  # type: ignore[union-attr]
    for m in (SessionUpdate, SessionCreate, SessionResume, SessionHeartbeat, SessionEventAck, SessionClose,
              InputAudioBufferAppend, InputAudioBufferCommit, InputAudioBufferClear, InputCancel,
              InputTextAppend, ConversationItemCreate, ConversationItemRetrieve, ConversationItemDelete,
              ConversationItemTruncate, ResponseCreate, ResponseCancel, OutputAudioBufferClear, BargeIn,
              TurnSignal, PlaybackAck)
)

# §3.1 alias -> canonical name.
ALIASES: dict[str, str] = {
    "open_session": "session.create",
    "session.config": "session.create",
    "close_session": "session.close",
    "close": "session.close",
    "session_close": "session.close",
    "input.audio.append": "input_audio_buffer.append",
    "push_chunk": "input_audio_buffer.append",
    "input.commit": "input_audio_buffer.commit",
    "input_text.append": "input.text.append",
    "push_text": "input.text.append",
    "signal_turn": "turn.signal",
    "audio.playback_ack": "playback.ack",
}
# Legacy append aliases default the chunk format to a WAV file (§3.1).
LEGACY_WAV_ALIASES: frozenset[str] = frozenset({"input.audio.append", "push_chunk"})
OPENING_TYPES: frozenset[str] = frozenset({"session.update", "session.create"})


def normalise_type(name: str) -> str | None:
    """Canonical name for `name`, or None if it is not a client event of this protocol."""
    canonical = ALIASES.get(name, name)
    return canonical if canonical in CANONICAL_TYPES else None
