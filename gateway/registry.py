"""Session registry: live session ids and incarnations with tombstones (§4.1). Capacity is `gateway.admission`."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.protocol.errors import ProtocolError


class SessionRegistry:
    def __init__(self, tombstone_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = tombstone_ttl_s
        self._clock = clock
        self._live: dict[str, int] = {}  # session id -> incarnation (open, detached or closing)
        self._tombstones: dict[str, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def check_free(self, session_id: str) -> None:
        """Raises session_exists for a live (open, detached or closing) id."""
        if session_id in self._live:
            raise ProtocolError("session_exists", f"session {session_id!r} is live", param="session.id")

    def reserve(self, session_id: str) -> int:
        """Reserve a live id; returns the incarnation. Raises session_exists."""
        self.check_free(session_id)
        now = self._clock()
        last, at = self._tombstones.pop(session_id, (0, now))
        incarnation = last + 1 if now - at <= self._ttl else 1
        self._live[session_id] = incarnation
        return incarnation

    def adopt(self, session_id: str, incarnation: int) -> None:
        """A live session of a dead gateway, hosted here from now on (gateway/directory/adopt.py): its incarnation
        is the one it has. Raises session_exists for a live id."""
        self.check_free(session_id)
        self._tombstones.pop(session_id, None)
        self._live[session_id] = incarnation

    def release(self, session_id: str) -> None:
        """After cleanup succeeded (AD-3); keeps a tombstone for the next incarnation."""
        incarnation = self._live.pop(session_id, None)
        if incarnation is not None:
            now = self._clock()
            self._prune(now)
            self._tombstones[session_id] = (incarnation, now)

    def _prune(self, now: float) -> None:
        """Forget tombstones past their TTL (they no longer change an incarnation): without this the map grew by
        one entry per session ever closed. Insertion order is release order, so the expired ones lead."""
        while self._tombstones:
            oldest = next(iter(self._tombstones))
            if now - self._tombstones[oldest][1] <= self._ttl:
                return
            del self._tombstones[oldest]
