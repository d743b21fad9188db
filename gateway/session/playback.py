"""Playback ledger and history commit positions (protocol.md §7).

One entry per response that carried audio. Cursors: generated >= sent >= played >= committed; acks are
max-monotonic; only a truncate may lower played/committed (§7.4 TR-2).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# §7.1 (b): playback is estimated finished this long after first send + sent audio.
PLAYBACK_ESTIMATE_SLACK_MS = 1500


@dataclass(slots=True)
class PlaybackEntry:
    response_id: str
    generated_ms: int = 0
    sent_ms: int = 0
    played_ms: int = 0
    committed_ms: int = 0
    acked: bool = False
    first_send_at: float | None = None  # gateway monotonic seconds
    done: bool = False
    history_final: bool = False
    history_chars: int = 0
    history_audio_ms: int = 0
    # marks: (audio_end_ms, text_chars), response-scoped and increasing (§7.5)
    marks: list[tuple[int, int]] = field(default_factory=list)

    def cursors(self) -> dict[str, int]:
        return {"generated_ms": self.generated_ms, "sent_ms": self.sent_ms, "played_ms": self.played_ms,
                "committed_ms": self.committed_ms}

    def text_chars_at(self, position_ms: int) -> int:
        """Transcript prefix length of the last mark with audio_end_ms <= position (§7.5)."""
        i = bisect.bisect_right([m[0] for m in self.marks], position_ms)
        return self.marks[i - 1][1] if i else 0

    def heard_ms(self, now: float) -> int:
        """Latest acked played_ms, else the wall-clock estimate capped at sent_ms (§7.3)."""
        if self.acked:
            return self.played_ms
        if self.first_send_at is None:
            return 0
        return min(self.sent_ms, int((now - self.first_send_at) * 1000))

    def playing(self, now: float) -> bool:
        """§7.1 playback-finished estimate, negated."""
        if self.acked and self.done and self.played_ms >= self.sent_ms:
            return False
        if self.first_send_at is None:
            return False
        return now * 1000 < self.first_send_at * 1000 + self.sent_ms + PLAYBACK_ESTIMATE_SLACK_MS

    def ack(self, played_ms: int, committed_ms: int | None, *, truncate: bool) -> tuple[int, int]:
        """Apply one ack; returns the effective (played_ms, committed_ms)."""
        played = min(played_ms, self.sent_ms)
        committed = min(played if committed_ms is None else committed_ms, played)
        self.acked = True
        if truncate:
            self.played_ms, self.committed_ms = played, committed
        else:
            self.played_ms = max(self.played_ms, played)
            self.committed_ms = max(self.committed_ms, min(committed, self.played_ms))
        return self.played_ms, self.committed_ms

    def committed_json(self) -> dict[str, Any]:
        return {"audio_ms": self.history_audio_ms, "text_chars": self.history_chars, "final": self.history_final}
