"""The one place that maps failures onto the wire: error events, effects and close codes (§1.6-§1.8)."""

from __future__ import annotations

import logging

from gateway.protocol.errors import CloseCode, Effect, ProtocolError, error_event, handshake_close_code
from gateway.session.outbox import Kind, OutItem

log = logging.getLogger(__name__)


def handshake_failure(err: ProtocolError, client_event_id: str | None = None) -> OutItem:
    """Handshake error: unsequenced, followed by closing the socket (nothing is retained)."""
    code = handshake_close_code(err.code)
    return OutItem(events=(error_event(err, client_event_id),), kind=Kind.UNSEQUENCED,
                   close=(int(code), err.code))


def rejected_frame(err: ProtocolError, client_event_id: str | None) -> OutItem:
    """reject-frame: the frame is dropped, nothing changes, the error is unsequenced (§1.4)."""
    return OutItem(events=(error_event(err, client_event_id),), kind=Kind.UNSEQUENCED)


def is_session_fatal(err: ProtocolError) -> bool:
    return err.effect is Effect.CLOSE_SESSION


def internal(exc: BaseException) -> ProtocolError:
    log.exception("internal gateway fault", exc_info=exc)
    return ProtocolError("internal_error", f"internal error: {exc.__class__.__name__}", effect=Effect.CLOSE_SESSION)


SESSION_CLOSED = (int(CloseCode.NORMAL), "session_closed")
SESSION_EXPIRED = (int(CloseCode.NORMAL), "session_expired")


def close_reason(err: ProtocolError) -> str:
    """`session.closed.reason` after a close-session error (§3.10)."""
    return {"runtime_dead": "runtime_failure", "output_buffer_overflow": "output_buffer_overflow"}.get(
        err.code, "internal_error")
