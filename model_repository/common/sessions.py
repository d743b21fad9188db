"""Per-sequence session records and the fence rule, shared by every stage adapter.

A fence is (incarnation, epoch, append_seq). Work whose (incarnation, epoch) is older than the
session's current one is stale forever; a cancel adopts NEXT_FENCE atomically. Appends must also
move append_seq forward within one epoch, so a replayed unit is rejected rather than run twice.
Only the adapter's execute thread touches this table (one owner, no lock needed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .codec import Fence, RequestError, StageRequest


@dataclass
class Session:
    corrid: int
    fence: Fence
    last_append: Fence | None = None
    last_seen: float = field(default_factory=time.monotonic)


class SessionTable:
    def __init__(self, max_sessions: int, idle_ttl_s: float) -> None:
        self.max_sessions, self.idle_ttl_s = max_sessions, idle_ttl_s
        self._sessions: dict[int, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, corrid: int) -> bool:
        return corrid in self._sessions

    def admit(self, req: StageRequest) -> Session:
        """Check `req` against its session and apply its state change; raise RequestError if refused."""
        if req.op == "open":
            return self._open(req)
        session = self._sessions.get(req.corrid)
        if session is None:
            raise RequestError("session_not_found", f"no open session for sequence {req.corrid}")
        if req.fence[:2] < session.fence[:2]:
            raise RequestError("stale_fence", f"fence {req.fence} is older than {session.fence}")
        if req.op == "append":
            if session.last_append is not None and req.fence <= session.last_append:
                raise RequestError("stale_fence", f"append {req.fence} does not follow {session.last_append}")
            session.last_append = req.fence
        if req.fence[:2] > session.fence[:2]:
            session.fence = req.fence
        if req.op == "cancel":
            assert req.next_fence is not None  # codec guarantees it
            if req.next_fence[:2] <= session.fence[:2]:
                raise RequestError("stale_fence", f"next fence {req.next_fence} must move past {session.fence}")
            session.fence = req.next_fence
        session.last_seen = time.monotonic()
        if req.op == "close":
            del self._sessions[req.corrid]
        return session

    def _open(self, req: StageRequest) -> Session:
        if req.corrid in self._sessions:
            raise RequestError("invalid_request", f"sequence {req.corrid} is already open")
        if len(self._sessions) >= self.max_sessions:
            raise RequestError("runtime_backpressure", f"max_sessions={self.max_sessions} sessions are open")
        session = Session(req.corrid, req.fence)
        self._sessions[req.corrid] = session
        return session

    def expire_idle(self) -> list[int]:
        """Forget sessions idle past the TTL (Triton drops their sequence slot too); return their ids."""
        cutoff = time.monotonic() - self.idle_ttl_s
        expired = [c for c, s in self._sessions.items() if s.last_seen < cutoff]
        for corrid in expired:
            del self._sessions[corrid]
        return expired
