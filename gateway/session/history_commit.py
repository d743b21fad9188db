"""History commit at `response.done` (protocol.md §7.3): what of a response's transcript enters history."""

from __future__ import annotations

from typing import Any

from gateway.session.history import ConversationRecord
from gateway.session.responses import Response


def commit_history(resp: Response, status: str, history: ConversationRecord, *, ack_only: bool,
                   now: float) -> dict[str, Any]:
    """Apply the policy table of §7.3; returns `duplex.committed` {audio_ms, text_chars, final}."""
    item = history.get(resp.item_id)
    item_status = "completed" if status == "completed" else "incomplete"
    entry = resp.playback
    if entry is None:  # text-only or no audio: the sent text is what the client saw
        text = resp.transcript if status != "failed" else ""
        if item is not None:
            item.text, item.status = text, item_status
        return {"audio_ms": 0, "text_chars": len(text), "final": status in ("completed", "incomplete")}
    if status == "failed":
        pos = 0  # uncommitted text of a failed response never enters history (§1.5)
    elif status in ("completed", "incomplete") and not ack_only:
        pos, entry.history_final = entry.generated_ms, True
    elif ack_only:
        pos = entry.committed_ms
        entry.history_final = status != "cancelled" and entry.committed_ms >= entry.generated_ms
    else:
        pos = entry.heard_ms(now)  # cancelled: latest ack, else the playback estimate capped at sent_ms
    chars = len(resp.transcript) if entry.history_final and not ack_only else entry.text_chars_at(pos)
    entry.history_audio_ms, entry.history_chars = pos, chars
    if item is not None:
        item.text, item.status = resp.transcript[:chars], item_status
    return entry.committed_json()
