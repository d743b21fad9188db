"""Messages on a connection's inbox and the connection's explicit states (starlette-style)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from gateway.protocol.errors import ProtocolError
from gateway.runtime.base import RuntimeEvent
from gateway.session.lane import LaneResult


class ConnState(enum.Enum):
    CONNECTING = "connecting"
    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Admitted:
    event: Any  # ce.ClientEvent, canonical name
    raw: dict
    generation: int = 1  # attachment_generation of the socket it came from (§1.3 attachment tag)


@dataclass(frozen=True, slots=True)
class Rejected:
    error: ProtocolError
    generation: int = 1


@dataclass(frozen=True, slots=True)
class RuntimeOut:
    event: RuntimeEvent


@dataclass(frozen=True, slots=True)
class LaneOut:
    result: LaneResult


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Disconnected:
    reason: str  # "disconnect" | "transport_error"
    generation: int = 1


@dataclass(frozen=True, slots=True)
class Expired:
    reason: str  # ExpiryReason value, from the lease reaper


@dataclass(frozen=True, slots=True)
class JournalOverflow:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class ResyncClose:
    pass  # a resume found a journal gap (J-5): close with reason resync_required


@dataclass(frozen=True, slots=True)
class Fatal:
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class OwnerLost:
    """Several gateways: the session's directory record is not this gateway's any more (gateway/directory/runtime.py)
    -- another gateway adopted the session (`moved`), or it was swept: it ends here without a word to the runtime."""
    moved: bool


Message = (Admitted | Rejected | RuntimeOut | LaneOut | Tick | Disconnected | Fatal | Expired | JournalOverflow
           | Shutdown | ResyncClose | OwnerLost)
ALLOWED: dict[ConnState, frozenset[ConnState]] = {
    ConnState.CONNECTING: frozenset({ConnState.HANDSHAKE, ConnState.CLOSED}),
    ConnState.HANDSHAKE: frozenset({ConnState.OPEN, ConnState.CLOSED}),
    ConnState.OPEN: frozenset({ConnState.CLOSING}),
    ConnState.CLOSING: frozenset({ConnState.CLOSED}),
    ConnState.CLOSED: frozenset(),
}
