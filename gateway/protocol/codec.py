"""Inbound frame decoding (protocol.md §1.3, §1.5): text frame -> canonical typed client event.

Every failure raises `ProtocolError` with the code the spec names; nothing here touches state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from gateway.protocol.client_events import (
    CLIENT_EVENT_ADAPTER,
    LEGACY_WAV_ALIASES,
    ClientEvent,
    normalise_type,
)
from gateway.protocol.errors import ProtocolError

MAX_TYPE_CHARS = 64
MAX_CLIENT_EVENT_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class FrameLimits:
    max_frame_bytes: int


def client_event_id(raw: object) -> str | None:
    """Best-effort `event_id` of a frame, for echoing in the error that rejects it."""
    if isinstance(raw, dict):
        eid = raw.get("event_id")
        if isinstance(eid, str) and 1 <= len(eid) <= MAX_CLIENT_EVENT_ID_CHARS:
            return eid
    return None


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    # Drop the union tag pydantic puts first ("session.update") so params read like `session.instructions`.
    parts = [str(p) for p in loc[1:]] if loc else []
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "type"


def decode_frame(text: str, limits: FrameLimits) -> tuple[ClientEvent, dict]:
    """Parse one text frame. Returns the typed event and the normalised raw dict."""
    if len(text.encode("utf-8", errors="surrogatepass")) > limits.max_frame_bytes:
        raise ProtocolError("event_too_large", f"frame exceeds {limits.max_frame_bytes} bytes")
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {exc.__class__.__name__}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_json", "frame is not a JSON object")
    try:
        return decode_object(raw)
    except ProtocolError as err:
        err.client_event_id = client_event_id(raw)
        raise


def decode_object(raw: dict) -> tuple[ClientEvent, dict]:
    name = raw.get("type")
    if not isinstance(name, str) or not name or len(name) > MAX_TYPE_CHARS:
        raise ProtocolError("bad_event", "missing, non-string or over-long `type`", param="type")
    if "event_id" in raw:
        eid = raw["event_id"]
        if not isinstance(eid, str) or not 1 <= len(eid) <= MAX_CLIENT_EVENT_ID_CHARS:
            raise ProtocolError("bad_event", "event_id must be a string of 1-128 characters",
                                param="event_id")
    canonical = normalise_type(name)
    if canonical is None:
        raise ProtocolError("unknown_event", f"unknown event type {name!r}", param="type")
    norm = dict(raw, type=canonical)
    if name in LEGACY_WAV_ALIASES and "format" not in norm and "input_audio_format" not in norm:
        norm["format"] = "wav"
    try:
        event = CLIENT_EVENT_ADAPTER.validate_python(norm)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ProtocolError("bad_event", f"{first['msg']}", param=_loc_to_param(first["loc"])) from None
    return event, norm
