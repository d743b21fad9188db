"""Session registry: atomic admission (protocol.md §5.2) and incarnations with tombstones (§4.1)."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.protocol.errors import ProtocolError


class SessionRegistry:
    def __init__(self, max_sessions: int, tombstone_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self._ttl = tombstone_ttl_s
        self._clock = clock
        self._live: dict[str, int] = {}  # session id -> incarnation (open, detached or closing)
        self._tombstones: dict[str, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def reserve(self, session_id: str) -> int:
        """AD-1 check-and-reserve; returns the incarnation. Raises session_exists / resource_exhausted."""
        if session_id in self._live:
            raise ProtocolError("session_exists", f"session {session_id!r} is live", param="session.id")
        if len(self._live) >= self.max_sessions:
            raise ProtocolError("resource_exhausted", f"duplex_session_capacity_exhausted: limit={self.max_sessions}")
        now = self._clock()
        last, at = self._tombstones.pop(session_id, (0, now))
        incarnation = last + 1 if now - at <= self._ttl else 1
        self._live[session_id] = incarnation
        return incarnation

    def release(self, session_id: str) -> None:
        """After cleanup succeeded (AD-3); keeps a tombstone for the next incarnation."""
        incarnation = self._live.pop(session_id, None)
        if incarnation is not None:
            self._tombstones[session_id] = (incarnation, self._clock())
