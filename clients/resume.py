"""Resume bookkeeping (protocol.md §6): the seq cursor with dedup and ack pacing, credentials, backoff."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

ACK_EVERY_S = 1.0  # J-2: ack at least every 1 s or every 32 events
ACK_EVERY_EVENTS = 32
FINAL_RESUME_CODES = frozenset({
    "invalid_session_resume", "session_resume_expired", "unsupported_session_resume", "invalid_resume_token",
    "session_resume_conflict"})  # final: a resume failing with these is never retried (CL-3)
RETRYABLE_RESUME_CODES = frozenset({"runtime_resume_failed"})
RESUME_ATTEMPTS = 5
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 4.0


class SeqTracker:
    """Highest processed `server_event_seq` (CL-1) and when to send `session.event_ack`.

    `accept` returns False for a replayed event the client already processed (J-6); unsequenced events
    (seq None) are always accepted.
    """

    def __init__(self) -> None:
        self.highest = 0
        self.acked = 0
        self._since_ack = 0
        self._last_ack_t: float | None = None

    def accept(self, seq: int | None) -> bool:
        if seq is None:
            return True
        if seq <= self.highest:
            return False
        self.highest = seq
        self._since_ack += 1
        return True

    def ack_due(self, now: float) -> int | None:
        """The seq to ack now, or None (nothing new, or neither 1 s nor 32 events since the last ack)."""
        if self.highest <= self.acked:
            return None
        if self._last_ack_t is None:
            self._last_ack_t = now  # the ack clock starts at the first unacked event
        if self._since_ack >= ACK_EVERY_EVENTS or now - self._last_ack_t >= ACK_EVERY_S:
            return self.highest
        return None

    def mark_acked(self, seq: int, now: float) -> None:
        self.acked = max(self.acked, seq)
        self._since_ack = 0
        self._last_ack_t = now


@dataclass(frozen=True)
class ResumeCredentials:
    session_id: str
    resume_token: str
    incarnation: int | None

    def resume_frame(self, last_received: int) -> dict[str, object]:
        frame: dict[str, object] = {"type": "session.resume", "session_id": self.session_id,
                                    "resume_token": self.resume_token,
                                    "last_received_server_event_seq": last_received}
        if self.incarnation is not None:
            frame["incarnation"] = self.incarnation
        return frame


def backoff_delays(rng: random.Random | None = None, attempts: int = RESUME_ATTEMPTS) -> Iterator[float]:
    """CL-3: uniform(0.25, min(4, 0.25 * 2**n)) seconds for attempt n = 0..attempts-1."""
    rng = rng or random.Random()
    for n in range(attempts):
        yield rng.uniform(BACKOFF_BASE_S, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** n))
