"""`ResponseCommands`: the client commands that act on responses, playback and history (protocol.md §3.1,
§3.6, §7): cancel, output clear, barge-in, playback ack, truncate, item retrieve/delete, event ack.

It holds no state of its own: it validates each command and applies it through the `ResponseTrack`.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol import client_events as ce
from gateway.protocol import server_events as se
from gateway.protocol.errors import ProtocolError
from gateway.session.core import SessionCore
from gateway.session.history import HistoryItem
from gateway.session.playback import PlaybackEntry
from gateway.session.response_track import ResponseTrack
from gateway.session.responses import Response

ADVISORY_SIGNALS = frozenset({"user_started", "user_committed", "assistant_started", "assistant_done", "timeout"})
REDISPATCHED_SIGNALS = frozenset({"input.cancel", "response.cancel", "barge_in"})


class ResponseCommands:
    def __init__(self, core: SessionCore, responses: ResponseTrack) -> None:
        self.core, self.responses = core, responses

    def response_cancel(self, ev: ce.ResponseCancel) -> None:
        active = self.responses.active
        if active is None or (ev.response_id is not None and ev.response_id != active.id):
            raise ProtocolError("response_not_active", "no such active response", param="response_id")
        self.responses.cancel_active("client_cancelled", cleared=False)

    def output_clear(self) -> None:
        if self.responses.cancel_active("output_cleared", cleared=True):
            return
        audio = [r for r in self.responses.by_id.values() if r.playback is not None]
        unacked = [r for r in audio if r.playback and r.playback.played_ms < r.playback.sent_ms]
        target = (unacked or audio or [None])[-1]
        if target is not None:  # idle clear: no runtime call, no epoch change (F-6)
            self.core.emit(se.OutputCleared(response_id=target.id).model_dump())

    def barge_in(self) -> None:
        if not self.responses.cancel_active("barge_in", cleared=True):
            raise ProtocolError("response_not_active", "barge_in with no active response")

    def overlap_barge_in(self, k1: dict[str, Any], reason: str) -> None:
        """B1-B3 (the overlap episode has ended): cancel a live response; or clear and truncate one that is
        still playing."""
        if self.responses.cancel_active(reason, cleared=True, k1=k1):
            return
        resp = self.responses.last_audio()
        if resp is None or resp.playback is None:
            return
        self.core.emit(k1)
        self.core.emit(se.OutputCleared(response_id=resp.id).model_dump())
        self._truncate(resp, resp.playback, resp.playback.heard_ms(self.core.clock()))

    def _resolve(self, response_id: str | None, item_id: str | None) -> Response:
        if response_id is None and item_id is None:
            raise ProtocolError("missing_item_id", "response_id or item_id is required", param="item_id")
        if response_id is not None and item_id is not None and item_id != f"item_{response_id}":
            raise ProtocolError("bad_event", "response_id and item_id disagree", param="item_id")
        rid = response_id if response_id is not None else (item_id or "")[len("item_"):]
        resp = self.responses.by_id.get(rid)
        if resp is None:
            raise ProtocolError("item_not_found", "unknown response or item", param="item_id")
        return resp

    def _truncate(self, resp: Response, entry: PlaybackEntry, audio_end_ms: int) -> None:
        """TR-2/TR-3: cancel a live response, then set the final heard position from the marks."""
        if not resp.terminal:
            self.responses.cancel_active("truncated", cleared=False)
        entry.ack(audio_end_ms, audio_end_ms, truncate=True)
        chars = entry.text_chars_at(audio_end_ms)
        entry.history_final, entry.history_chars, entry.history_audio_ms = True, chars, audio_end_ms
        item = self.responses.history.get(resp.item_id)
        if item is not None:
            item.text = resp.transcript[:chars]
        self.core.emit(se.ItemTruncated(item_id=resp.item_id, content_index=0,
                                        audio_end_ms=audio_end_ms).model_dump())

    def item_truncate(self, ev: ce.ConversationItemTruncate) -> None:
        if ev.item_id is None:
            raise ProtocolError("missing_item_id", "item_id is required", param="item_id")
        hist = self.responses.history.get(ev.item_id)
        resp = self.responses.by_id.get(ev.item_id[len("item_"):])
        if hist is not None and hist.role == "user":
            raise ProtocolError("item_not_truncatable", "only assistant items can be truncated", param="item_id")
        if resp is None:
            raise ProtocolError("item_not_found", "unknown item", param="item_id")
        entry = resp.playback or PlaybackEntry(resp.id)
        if ev.audio_end_ms > entry.sent_ms:
            raise ProtocolError("bad_event", "audio_end_ms beyond the audio sent", param="audio_end_ms")
        resp.playback = entry
        self._truncate(resp, entry, ev.audio_end_ms)

    def playback_ack(self, ev: ce.PlaybackAck) -> None:
        resp = self._resolve(ev.response_id, ev.item_id)
        entry = resp.playback
        if entry is None:
            raise ProtocolError("item_not_found", "that response carried no audio", param="response_id")
        if ev.truncate and ev.played_ms > entry.sent_ms:
            raise ProtocolError("bad_event", "played_ms beyond the audio sent", param="played_ms")
        before = entry.history_chars
        if ev.truncate:
            self._truncate(resp, entry, ev.played_ms)
            played, committed = entry.played_ms, entry.committed_ms
        else:
            played, committed = entry.ack(ev.played_ms, ev.committed_ms, truncate=False)
            self._extend_history(resp, entry)
        self.core.emit(se.PlaybackAcknowledged(
            session_id=self.core.session_id, epoch=self.responses.epoch, response_id=resp.id, item_id=resp.item_id,
            played_ms=played, committed_ms=committed, truncate=ev.truncate, playback=entry.cursors(),
            history_committed=entry.history_chars != before, committed_text_chars=entry.history_chars).model_dump())

    def _extend_history(self, resp: Response, entry: PlaybackEntry) -> None:
        """Later acks may extend an open history entry (§7.3); a final entry changes only by truncate."""
        policy = self.core.config.playback_commit_policy
        if entry.history_final or not resp.terminal and policy != "ack_only":
            return
        pos = entry.committed_ms if policy == "ack_only" else entry.played_ms
        chars = entry.text_chars_at(pos)
        if chars > entry.history_chars:
            entry.history_chars, entry.history_audio_ms = chars, pos
            item = self.responses.history.get(resp.item_id)
            if item is not None:
                item.text = resp.transcript[:chars]
        if policy == "ack_only" and entry.done and entry.committed_ms >= entry.generated_ms:
            entry.history_final = True

    def item_retrieve(self, ev: ce.ConversationItemRetrieve) -> None:
        item = self._history_item(ev.item_id)
        self.core.emit(se.ItemRetrieved(item=item.to_json()).model_dump())

    def item_delete(self, ev: ce.ConversationItemDelete) -> None:
        item = self._history_item(ev.item_id)
        active = self.responses.active
        if active is not None and item.id == active.item_id:
            raise ProtocolError("bad_event", "cannot delete the active assistant item", param="item_id")
        self.responses.history.delete(item.id)
        self.core.emit(se.ItemDeleted(item_id=item.id).model_dump())

    def _history_item(self, item_id: str | None) -> HistoryItem:
        if item_id is None:
            raise ProtocolError("missing_item_id", "item_id is required", param="item_id")
        item = self.responses.history.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"unknown item {item_id!r}", param="item_id")
        return item

    def event_ack(self, ev: ce.SessionEventAck) -> None:
        seq = ev.server_event_seq
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= self.core.last_seq:
            raise ProtocolError("invalid_event_ack", "server_event_seq must be an integer in [0, last seq]",
                                param="server_event_seq")
