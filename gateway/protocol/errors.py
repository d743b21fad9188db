"""Error codes of protocol.md §1.7, their class/retryable/effect, and WebSocket close codes (§1.8).

`ProtocolError` is the single exception type the session logic raises for anything that
becomes an `error` event; `gateway.ws.faults` is the one place that maps it onto the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorClass(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"


class Effect(enum.StrEnum):
    HANDSHAKE = "hs"
    REJECT_FRAME = "reject-frame"
    FAIL_RESPONSE = "fail-response"
    REPORT = "report"
    CLOSE_SESSION = "close-session"


class CloseCode(enum.IntEnum):
    NORMAL = 1000
    GOING_AWAY = 1001
    POLICY = 1008
    TOO_BIG = 1009
    INTERNAL = 1011
    TRY_AGAIN = 1013


@dataclass(frozen=True, slots=True)
class CodeSpec:
    cls: ErrorClass
    retryable: bool
    effect: Effect


_IR, _RL, _SE = ErrorClass.INVALID_REQUEST, ErrorClass.RATE_LIMIT, ErrorClass.SERVER
_HS, _RF, _FR, _RP, _CS = (Effect.HANDSHAKE, Effect.REJECT_FRAME, Effect.FAIL_RESPONSE, Effect.REPORT,
                           Effect.CLOSE_SESSION)

# code -> (class, retryable, default effect). "hs / reject-frame" codes carry their post-handshake effect;
# the handshake path forces HANDSHAKE itself.
CODES: dict[str, CodeSpec] = {
    "unsupported": CodeSpec(_IR, False, _HS),
    "invalid_json": CodeSpec(_IR, False, _RF),
    "config_timeout": CodeSpec(_IR, False, _HS),
    "bad_event": CodeSpec(_IR, False, _RF),
    "unknown_event": CodeSpec(_IR, False, _RF),
    "event_too_large": CodeSpec(_IR, False, _RF),
    "model_not_found": CodeSpec(_IR, False, _HS),
    "session_exists": CodeSpec(_IR, False, _HS),
    # Deployment auth (issue 9, gateway.auth): not in protocol.md §1.7, which leaves auth to deployments.
    "invalid_api_key": CodeSpec(_IR, False, _HS),
    "origin_not_allowed": CodeSpec(_IR, False, _HS),
    "host_not_allowed": CodeSpec(_IR, False, _HS),
    "resource_exhausted": CodeSpec(_RL, True, _HS),
    "runtime_unavailable": CodeSpec(_SE, True, _HS),
    "runtime_open_failed": CodeSpec(_SE, True, _HS),
    "runtime_contract_invalid": CodeSpec(_SE, False, _HS),
    "invalid_session_resume": CodeSpec(_IR, False, _HS),
    "session_resume_expired": CodeSpec(_IR, False, _HS),
    "invalid_resume_token": CodeSpec(_IR, False, _HS),
    "unsupported_session_resume": CodeSpec(_IR, False, _RF),
    "session_resume_conflict": CodeSpec(_IR, False, _HS),
    "runtime_resume_failed": CodeSpec(_SE, True, _HS),
    "bad_audio": CodeSpec(_IR, False, _RF),
    "bad_video_frames": CodeSpec(_IR, False, _RF),
    "unsupported_audio_format": CodeSpec(_IR, False, _RF),
    "unsupported_ref_audio_path": CodeSpec(_IR, False, _RF),
    "ref_audio_required": CodeSpec(_IR, False, _RF),
    "invalid_voice": CodeSpec(_IR, False, _RF),
    "server_owned_config_key": CodeSpec(_IR, False, _RF),
    "model_update_unsupported": CodeSpec(_IR, False, _RF),
    "instructions_update_after_audio_unsupported": CodeSpec(_IR, False, _RF),
    "voice_update_after_audio_unsupported": CodeSpec(_IR, False, _RF),
    "ref_audio_update_unsupported": CodeSpec(_IR, False, _RF),
    "invalid_runtime_config": CodeSpec(_IR, False, _RF),
    "unsupported_turn_detection": CodeSpec(_IR, False, _RF),
    "unsupported_response_modality": CodeSpec(_IR, False, _RF),
    "unsupported_response_option": CodeSpec(_IR, False, _RF),
    "native_text_append_unsupported": CodeSpec(_IR, False, _RF),
    "unsupported_item_type": CodeSpec(_IR, False, _RF),
    "item_not_truncatable": CodeSpec(_IR, False, _RF),
    "missing_item_id": CodeSpec(_IR, False, _RF),
    "item_not_found": CodeSpec(_IR, False, _RF),
    "invalid_event_ack": CodeSpec(_IR, False, _RF),
    "barge_in_unsupported": CodeSpec(_IR, False, _RF),
    "response_already_active": CodeSpec(_IR, False, _RF),
    "response_not_active": CodeSpec(_IR, False, _RF),
    "response_create_without_input": CodeSpec(_IR, False, _RF),
    "input_audio_buffer_empty": CodeSpec(_IR, False, _RF),
    "input_backpressure": CodeSpec(_RL, True, _RF),
    "runtime_backpressure": CodeSpec(_RL, True, _RF),
    "runtime_update_failed": CodeSpec(_SE, True, _RF),
    "runtime_timeout": CodeSpec(_SE, True, _RF),
    "runtime_append_failed": CodeSpec(_SE, False, _FR),
    "runtime_stream_failed": CodeSpec(_SE, False, _FR),
    "response_error": CodeSpec(_SE, False, _FR),
    "runtime_signal_failed": CodeSpec(_SE, False, _RP),
    "runtime_abort_failed": CodeSpec(_SE, False, _RP),
    "runtime_close_failed": CodeSpec(_SE, False, _RP),
    "runtime_touch_failed": CodeSpec(_SE, True, _RP),
    "runtime_dead": CodeSpec(_SE, True, _CS),
    "output_buffer_overflow": CodeSpec(_SE, False, _CS),
    "internal_error": CodeSpec(_SE, False, _RP),
}

# Handshake close codes (§1.8); every other handshake code closes with 1008.
_HS_CLOSE: dict[str, CloseCode] = {
    "resource_exhausted": CloseCode.TRY_AGAIN,
    "runtime_unavailable": CloseCode.TRY_AGAIN,
    "runtime_open_failed": CloseCode.INTERNAL,
    "runtime_resume_failed": CloseCode.INTERNAL,
    "runtime_contract_invalid": CloseCode.INTERNAL,
    "internal_error": CloseCode.INTERNAL,
}


def handshake_close_code(code: str) -> CloseCode:
    return _HS_CLOSE.get(code, CloseCode.POLICY)


def spec_of(code: str) -> CodeSpec:
    """Unknown codes are treated as non-retryable invalid requests (§1.6 last paragraph)."""
    return CODES.get(code, CodeSpec(_IR, False, _RF))


class ProtocolError(Exception):
    """A protocol-level failure that becomes exactly one `error` event."""

    def __init__(self, code: str, message: str, *, param: str | None = None,
                 effect: Effect | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param
        self.effect = effect if effect is not None else spec_of(code).effect
        self.client_event_id: str | None = None  # set by the codec when the frame had a usable event_id

    @property
    def spec(self) -> CodeSpec:
        return spec_of(self.code)


def error_event(err: ProtocolError, client_event_id: str | None) -> dict:
    """Canonical nested `error` event (§1.6); the native profile flattens it at send time."""
    spec = err.spec
    return {"type": "error", "error": {"type": spec.cls.value, "code": err.code, "message": err.message,
                                       "param": err.param, "event_id": client_event_id,
                                       "retryable": spec.retryable}}
