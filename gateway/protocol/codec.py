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
        if isinstance(eid, str) and 1 <= len(eid) <= MAX_CLIENT_EVENT_ID_CHARS and not _has_lone_surrogate(eid):
            return eid
    return None


def _has_lone_surrogate(value: object) -> bool:
    """True when a string anywhere in a parsed frame holds a lone UTF-16 surrogate (JSON `"\\udfff"`): valid
    JSON syntax but not Unicode text, so it could never be echoed or stored as UTF-8. Iterative: a frame may
    nest as deep as the JSON parser allows."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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
    except (ValueError, RecursionError) as exc:
        # ValueError besides JSONDecodeError: an integer of more than sys.get_int_max_str_digits() digits
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {exc.__class__.__name__}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_json", "frame is not a JSON object")
    # a surrogate can only come from a backslash-u escape (the socket delivers decoded UTF-8): skip the walk otherwise
    if "\\u" in text and _has_lone_surrogate(raw):
        raise ProtocolError("invalid_json", "frame holds a lone UTF-16 surrogate (not Unicode text)")
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
