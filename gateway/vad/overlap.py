"""Overlap policies and `overlap.decision` (protocol.md §8.3).

*Overlap* is input while `turn_state` is `assistant_generating` or `assistant_playing`. `OverlapEpisode`
holds one session's episode (accumulated `overlap_ms`, last decision) and decides each overlapping append
with rows O1-O9, first match wins. The caller ends the episode at commit, clear, barge-in (done here) or
when the assistant becomes inactive, and runs the barge-in cancel path (§8.4) for `action == "barge_in"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# §3.1.1 `overlap_action` groups -> canonical action.
CLIENT_ACTIONS = {"barge_in": "barge_in", "interrupt": "barge_in", "cancel": "barge_in",
                  "listen": "listen", "continue": "listen", "ack": "listen",
                  "drop": "drop", "ignore": "drop", "silence": "drop"}
POLICIES = ("listen_only", "barge_in_on_speech", "auto")


def client_action(overlap_action: str | None, force_barge_in: bool | None) -> str | None:
    """The client's overlap verdict, which wins over every policy (O1): `force_barge_in` or a known
    `overlap_action`, canonicalised; None when absent."""
    if force_barge_in:
        return "barge_in"
    return CLIENT_ACTIONS.get(overlap_action.lower()) if overlap_action else None


@dataclass(frozen=True, slots=True)
class OverlapChunk:
    """What the policy needs to know about one overlapping append."""
    is_speech: bool  # §8.2 classification (VAD, client hint, or RMS)
    duration_ms: float
    vad_on: bool = False
    onset_confirmed: bool = False  # VAD confirmed a speech start here: barge_in_on_speech barges in (O4)
    client_action: str | None = None  # the client's canonical verdict; it decides first (O1)
    auto_response: bool = True  # effective auto_response: names the listen_only reason (O3)


@dataclass(frozen=True, slots=True)
class OverlapDecision:
    action: str  # barge_in | listen | drop | ignore
    reason: str
    overlap_ms: float
    emit: bool  # send `overlap.decision` for this append (§8.3 Emission)

    @property
    def barge_in(self) -> bool:
        return self.action == "barge_in"

    def event(self, *, session_id: str, epoch: int, response_id: str | None, policy: str,
              force_listen: bool = False) -> dict[str, Any]:
        """The `overlap.decision` payload (sequenced; the writer stamps envelope fields)."""
        return {"type": "overlap.decision", "session_id": session_id, "epoch": epoch, "response_id": response_id,
                "policy": policy, "action": self.action, "reason": self.reason,
                "metadata": {"overlap_ms": int(self.overlap_ms), "buffer_audio": self.action != "drop",
                             "defer_runtime_append": False, "force_listen": force_listen}}


class OverlapEpisode:
    def __init__(self) -> None:
        self.active = False
        self.overlap_ms = 0.0
        self._last: tuple[str, str] | None = None

    def end(self) -> None:
        self.active, self.overlap_ms, self._last = False, 0.0, None

    def decide(self, chunk: OverlapChunk, *, policy: str, short_ack_ms: int, barge_in_ms: int) -> OverlapDecision:
        started = False
        if not self.active and (chunk.is_speech or chunk.client_action is not None):
            self.active, started = True, True  # the episode starts at its first speech (or verdict) chunk
        if chunk.is_speech and self.active:
            self.overlap_ms += chunk.duration_ms
        action, reason = _rule(chunk, policy, self.overlap_ms, short_ack_ms, barge_in_ms)
        emit = self.active and (started or (action, reason) != self._last or action == "barge_in")
        decision = OverlapDecision(action, reason, self.overlap_ms, emit)
        self._last = (action, reason)
        if action == "barge_in":
            self.end()  # the episode ends at barge-in
        return decision


def _rule(c: OverlapChunk, policy: str, overlap_ms: float, short_ack_ms: int, barge_in_ms: int) -> tuple[str, str]:
    """(action, reason) by the §8.3 table, first match wins: the client's verdict (O1), non-speech is ignored
    (O2), then the policy's rows: barge_in_on_speech (O4-O6), auto (O7-O9), listen_only (O3)."""
    if c.client_action is not None:
        return c.client_action, "client_overlap_action"
    if not c.is_speech:
        return "ignore", "non_speech"
    if policy == "barge_in_on_speech":
        if c.vad_on and c.onset_confirmed:
            return "barge_in", "server_vad_utterance_active"
        if not c.vad_on and overlap_ms >= barge_in_ms:
            return "barge_in", "long_overlap_speech"
        return "listen", "overlap_pending"
    if policy == "auto":
        if overlap_ms <= short_ack_ms:
            return "listen", "short_overlap"
        if overlap_ms < barge_in_ms:
            return "listen", "overlap_pending"
        return "barge_in", "long_overlap_speech"
    # listen_only: speech is listened to, never a barge-in; the model keeps its own decision (O3)
    return "listen", "auto_response_continuous" if c.auto_response else "listen_only_policy"
