"""Overlap policy decisions without server VAD (protocol.md §8.3 O1-O3, O5-O9).

A pure function: the session feeds it the chunk's speech verdict and the episode's accumulated
`overlap_ms`, and acts on the returned verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

_CLIENT_GROUPS = {
    **dict.fromkeys(("barge_in", "interrupt", "cancel"), "barge_in"),
    **dict.fromkeys(("listen", "continue", "ack"), "listen"),
    **dict.fromkeys(("drop", "ignore", "silence"), "drop"),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    action: str  # listen | ignore | drop | barge_in
    reason: str
    client: bool = False  # O1: the client's own verdict (cancel reason `barge_in`, not `turn_detected`)


def client_action(overlap_action: str | None, force_barge_in: bool) -> str | None:
    if force_barge_in:
        return "barge_in"
    return _CLIENT_GROUPS.get(overlap_action or "")


def decide(policy: str, *, client: str | None, is_speech: bool, overlap_ms: float, short_ack_ms: int,
           barge_in_ms: int, auto_response: bool) -> Verdict:
    """First matching row of the §8.3 table wins (server VAD rows O4 are not served here)."""
    if client is not None:
        return Verdict(client, "client_overlap_action", client=True)
    if not is_speech:
        return Verdict("ignore", "non_speech")
    if policy == "listen_only":
        return Verdict("listen", "auto_response_continuous" if auto_response else "listen_only_policy")
    if policy == "barge_in_on_speech":
        if overlap_ms >= barge_in_ms:
            return Verdict("barge_in", "long_overlap_speech")
        return Verdict("listen", "overlap_pending")
    if overlap_ms <= short_ack_ms:
        return Verdict("listen", "short_overlap")
    if overlap_ms < barge_in_ms:
        return Verdict("listen", "overlap_pending")
    return Verdict("barge_in", "long_overlap_speech")
