"""Replay journal (protocol.md §6.3): the exact bytes of every sequenced event, keyed by `server_event_seq`.

The writer asks `offer(seq, data)` before sending a sequenced event (or instead of sending it, while
detached). Entries leave by `session.event_ack` (J-2) or by age (J-3, pruned first, on the injected
monotonic clock); if the retained bytes would exceed the cap the journal refuses the entry, stops for good
(J-4) and the writer sends `session.resync_required{journal_overflow}` and only unsequenced events after it.
Entries are never evicted silently.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from gateway.protocol.errors import Effect, ProtocolError


@dataclass(frozen=True, slots=True)
class JournalConfig:
    ttl_s: float  # resume_replay_ttl_s
    max_bytes: int  # resume_replay_max_bytes_per_session

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.max_bytes <= 0:
            raise ValueError("journal limits must be > 0")


@dataclass(frozen=True, slots=True)
class _Entry:
    seq: int
    data: bytes
    at: float


class JournalMirror(Protocol):
    """A copy of the journal kept elsewhere (several gateways: Redis, gateway/directory/replica.py). Told of every
    change as it happens, on the writer's path: it must only note the change, never wait."""

    def appended(self, seq: int, data: bytes) -> None: ...
    def trimmed(self, upto_seq: int, *, aged: bool) -> None: ...  # entries <= upto_seq left (ack, or age: J-3)
    def overflowed(self) -> None: ...  # J-4: the journal stopped and holds nothing


class JournalGap(Exception):
    """J-5: a seq the client has not received was pruned by age; the session must resync."""


class Journal:
    def __init__(self, config: JournalConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._entries: collections.deque[_Entry] = collections.deque()
        self._bytes = 0
        self.last_seq = 0  # highest seq assigned (and journaled)
        self.acked_seq = 0  # max-monotonic client ack
        self._aged_out_seq = 0  # highest seq pruned by age (J-3), not by ack
        self.overflowed = False
        self.mirror: JournalMirror | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    @property
    def sequencing(self) -> bool:
        """False after an overflow: later events go out without `server_event_seq` (§1.4)."""
        return not self.overflowed

    @property
    def next_seq(self) -> int:
        return self.last_seq + 1

    def offer(self, seq: int, data: bytes) -> bool:
        """Journal one sequenced event. False means overflow (J-4): the caller must not use `seq`."""
        if self.overflowed:
            return False
        if seq != self.last_seq + 1:
            raise ValueError(f"seq {seq} is not contiguous after {self.last_seq}")
        self.prune()
        if self._bytes + len(data) > self.config.max_bytes:
            self.overflowed = True
            self._entries.clear()
            self._bytes = 0
            if self.mirror is not None:
                self.mirror.overflowed()
            return False
        self._entries.append(_Entry(seq, bytes(data), self._clock()))
        self._bytes += len(data)
        self.last_seq = seq
        if self.mirror is not None:
            self.mirror.appended(seq, data)
        return True

    def ack(self, seq: object) -> None:
        """J-2: drop entries <= seq; acks are max-monotonic. Raises `invalid_event_ack` (reject-frame)."""
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= self.last_seq:
            raise ProtocolError("invalid_event_ack", "server_event_seq must be an integer in [0, last seq]",
                                param="server_event_seq", effect=Effect.REJECT_FRAME)
        if seq <= self.acked_seq:
            return
        self.acked_seq = seq
        while self._entries and self._entries[0].seq <= seq:
            self._bytes -= len(self._entries.popleft().data)
        if self.mirror is not None:
            self.mirror.trimmed(seq, aged=False)

    def prune(self) -> int:
        """J-3: drop entries older than the TTL even if unacknowledged. Returns how many were dropped."""
        horizon = self._clock() - self.config.ttl_s
        dropped = 0
        while self._entries and self._entries[0].at < horizon:
            entry = self._entries.popleft()
            self._bytes -= len(entry.data)
            self._aged_out_seq = entry.seq
            dropped += 1
        if dropped and self.mirror is not None:
            self.mirror.trimmed(self._aged_out_seq, aged=True)
        return dropped

    @property
    def aged_out_seq(self) -> int:
        return self._aged_out_seq

    def entries(self) -> list[tuple[int, bytes]]:
        """The retained (seq, bytes), oldest first."""
        return [(e.seq, e.data) for e in self._entries]

    def restore(self, entries: Iterable[tuple[int, bytes, float]], *, last_seq: int, acked_seq: int,
                aged_out_seq: int) -> None:
        """A journal rebuilt from its mirror (a dead gateway's session adopted, gateway/directory/adopt.py):
        `entries` are (seq, bytes, age in seconds), contiguous and ending at `last_seq`. Only on an empty journal,
        before any mirror is set; entries past the TTL are pruned at once (J-3), as they would have been."""
        if self._entries or self.last_seq or self.mirror is not None:
            raise RuntimeError("restore needs a new journal")
        now = self._clock()
        for seq, data, age_s in sorted(entries):
            if seq > acked_seq:
                self._entries.append(_Entry(seq, bytes(data), now - age_s))
                self._bytes += len(data)
        self.last_seq, self.acked_seq, self._aged_out_seq = last_seq, acked_seq, aged_out_seq
        seqs = [e.seq for e in self._entries]
        if seqs and seqs != list(range(seqs[0], last_seq + 1)):
            raise ValueError(f"journal entries {seqs[0]}..{seqs[-1]} are not contiguous up to {last_seq}")
        self.prune()

    def check_cursor(self, last_received: int) -> None:
        """RS5 (cursor beyond the last assigned seq -> `invalid_session_resume`) and RS6/J-5 (gap)."""
        if last_received > self.last_seq:
            raise ProtocolError("invalid_session_resume", "last_received_server_event_seq is beyond the last seq",
                                param="last_received_server_event_seq", effect=Effect.HANDSHAKE)
        self.prune()
        # Seqs the client acknowledged count as received even if they are gone.
        if self._aged_out_seq > max(last_received, self.acked_seq):
            raise JournalGap(f"seqs up to {self._aged_out_seq} aged out")

    def replay(self, last_received: int) -> list[bytes]:
        """RS9/J-6: the exact bytes of every retained event with seq > cursor, in order."""
        self.check_cursor(last_received)
        return [e.data for e in self._entries if e.seq > last_received]


# ---- writer-side glue: sequenced events journaled as sent, overflow stops journaling (§1.4, J-1, J-4) ------
Frame = Callable[[int | None], str]


class Sequencer:
    """Assigns seqs through the journal. The writer hands over `frame(seq)`, which serialises the projected
    event with `server_event_seq = seq` (or without it for None); the exact text bytes are journaled. On the
    first overflow `session.resync_required{journal_overflow}` goes in front of the event, which is then
    sent unsequenced, as is everything after it.
    """

    def __init__(self, journal: Journal, resync_frame: Callable[[int], str],
                 on_overflow: Callable[[], None] = lambda: None) -> None:
        """`resync_frame(last_seq)` serialises the unsequenced `session.resync_required` event."""
        self._journal = journal
        self._resync_frame = resync_frame
        self._on_overflow = on_overflow

    @property
    def last_seq(self) -> int:
        return self._journal.last_seq

    def frames(self, frame: Frame, *, sequenced: bool) -> list[str]:
        """The texts to send (or, while detached, to drop after journaling), in order."""
        if not sequenced or not self._journal.sequencing:
            return [frame(None)]
        seq = self._journal.next_seq
        text = frame(seq)
        if self._journal.offer(seq, text.encode("utf-8")):
            return [text]
        self._on_overflow()  # J-4: mark non-resumable, count duplex_journal_overflow_total
        return [self._resync_frame(self._journal.last_seq), frame(None)]


def resync_required_event(session_id: str, reason: str, last_seq: int) -> dict[str, object]:
    """`session.resync_required` payload (§3.2): unsequenced, never journaled."""
    return {"type": "session.resync_required", "session_id": session_id, "reason": reason,
            "last_server_event_seq": last_seq}
