"""Client command handlers of the session (protocol.md §3.1): responses, playback, items, signals."""

from __future__ import annotations

import dataclasses

import numpy as np

from gateway.protocol import client_events as ce
from gateway.protocol import server_events as se
from gateway.protocol.config import response_options
from gateway.protocol.errors import ProtocolError
from gateway.session.playback import PlaybackEntry
from gateway.session.responses import Response
from gateway.session.units import MODEL_RATE_HZ
from gateway.session.vad_input import VadMixin
from gateway.session.view import turn_state
from gateway.vad.overlap import OverlapChunk, client_action

ADVISORY_SIGNALS = frozenset({"user_started", "user_committed", "assistant_started", "assistant_done", "timeout"})
REDISPATCHED_SIGNALS = frozenset({"input.cancel", "response.cancel", "barge_in"})


class CommandsMixin(VadMixin):
    def append(self, ev: ce.InputAudioBufferAppend) -> None:
        prep = self.prepare_audio(ev)
        state = turn_state(self)
        if state not in ("assistant_generating", "assistant_playing"):
            self.end_overlap_episode()
            self.accept_audio(prep, force_listen=ev.force_listen, final=ev.final)
            return
        cfg = self.config
        client = client_action(ev.overlap_action, ev.force_barge_in)
        d = self.overlap.decide(OverlapChunk(prep.is_speech, len(prep.samples16k) * 1000 / MODEL_RATE_HZ,
                                             vad_on=self.vad is not None,
                                             onset_confirmed=prep.vad is not None and prep.vad.onset_confirmed,
                                             client_action=client, auto_response=cfg.effective_auto_response),
                                policy=cfg.effective_overlap_policy, short_ack_ms=cfg.overlap_short_ack_ms,
                                barge_in_ms=cfg.overlap_barge_in_ms)
        playing = self._active or self._responses.get(self._last_audio_response or "")
        decision = d.event(session_id=self.session_id, epoch=self.epoch, response_id=playing.id if playing else None,
                           policy=cfg.effective_overlap_policy, force_listen=ev.force_listen)
        if d.barge_in:
            self._barge_in(decision, "barge_in" if d.reason == "client_overlap_action" else "turn_detected")
        elif d.emit:
            self.emit(decision)
        if d.action == "drop":  # silence of equal length keeps the model clock continuous
            prep = dataclasses.replace(prep, samples16k=np.zeros_like(prep.samples16k), is_speech=False)
        self.accept_audio(prep, force_listen=ev.force_listen, final=ev.final, keep=d.action != "drop")
    def _barge_in(self, k1: dict, reason: str) -> None:
        """B1-B3: cancel a live response; or clear and truncate one that is still playing."""
        self.end_overlap_episode()
        if self.cancel_active(reason, cleared=True, k1=k1):
            return
        resp = self._responses.get(self._last_audio_response or "")
        if resp is None or resp.playback is None:
            return
        self.emit(k1)
        self.emit(se.OutputCleared(response_id=resp.id).model_dump())
        self._truncate(resp, resp.playback, resp.playback.heard_ms(self.clock()))

    def end_overlap_episode(self) -> None:
        self.overlap.end()

    def response_create(self, ev: ce.ResponseCreate) -> None:
        opts = response_options(ev.response, self.config)
        if self._active is not None:
            raise ProtocolError("response_already_active", "a response is already active")
        if not self.has_unconsumed_input():
            raise ProtocolError("response_create_without_input", "no unconsumed committed input")
        self.open_response("response_create", opts, precreated=True, input_item_id=self.response_input_item())

    def response_cancel(self, ev: ce.ResponseCancel) -> None:
        if self._active is None or (ev.response_id is not None and ev.response_id != self._active.id):
            raise ProtocolError("response_not_active", "no such active response", param="response_id")
        self.cancel_active("client_cancelled", cleared=False)

    def output_clear(self) -> None:
        if self.cancel_active("output_cleared", cleared=True):
            return
        audio = [r for r in self._responses.values() if r.playback is not None]
        unacked = [r for r in audio if r.playback and r.playback.played_ms < r.playback.sent_ms]
        target = (unacked or audio or [None])[-1]
        if target is not None:  # idle clear: no runtime call, no epoch change (F-6)
            self.emit(se.OutputCleared(response_id=target.id).model_dump())

    def barge_in(self) -> None:
        if not self.cancel_active("barge_in", cleared=True):
            raise ProtocolError("response_not_active", "barge_in with no active response")

    def _resolve(self, response_id: str | None, item_id: str | None) -> Response:
        if response_id is None and item_id is None:
            raise ProtocolError("missing_item_id", "response_id or item_id is required", param="item_id")
        if response_id is not None and item_id is not None and item_id != f"item_{response_id}":
            raise ProtocolError("bad_event", "response_id and item_id disagree", param="item_id")
        rid = response_id if response_id is not None else (item_id or "")[len("item_"):]
        resp = self._responses.get(rid)
        if resp is None:
            raise ProtocolError("item_not_found", "unknown response or item", param="item_id")
        return resp

    def _truncate(self, resp: Response, entry: PlaybackEntry, audio_end_ms: int) -> None:
        """TR-2/TR-3: cancel a live response, then set the final heard position from the marks."""
        if not resp.terminal:
            self.cancel_active("truncated", cleared=False)
        entry.ack(audio_end_ms, audio_end_ms, truncate=True)
        chars = entry.text_chars_at(audio_end_ms)
        entry.history_final, entry.history_chars, entry.history_audio_ms = True, chars, audio_end_ms
        item = self._history.get(resp.item_id)
        if item is not None:
            item.text = resp.transcript[:chars]
        self.emit(se.ItemTruncated(item_id=resp.item_id, content_index=0, audio_end_ms=audio_end_ms).model_dump())

    def item_truncate(self, ev: ce.ConversationItemTruncate) -> None:
        if ev.item_id is None:
            raise ProtocolError("missing_item_id", "item_id is required", param="item_id")
        hist = self._history.get(ev.item_id)
        resp = self._responses.get(ev.item_id[len("item_"):])
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
        self.emit(se.PlaybackAcknowledged(
            session_id=self.session_id, epoch=self.epoch, response_id=resp.id, item_id=resp.item_id,
            played_ms=played, committed_ms=committed, truncate=ev.truncate, playback=entry.cursors(),
            history_committed=entry.history_chars != before, committed_text_chars=entry.history_chars).model_dump())

    def _extend_history(self, resp: Response, entry: PlaybackEntry) -> None:
        """Later acks may extend an open history entry (§7.3); a final entry changes only by truncate."""
        if entry.history_final or not resp.terminal and self.config.playback_commit_policy != "ack_only":
            return
        pos = entry.committed_ms if self.config.playback_commit_policy == "ack_only" else entry.played_ms
        chars = entry.text_chars_at(pos)
        if chars > entry.history_chars:
            entry.history_chars, entry.history_audio_ms = chars, pos
            item = self._history.get(resp.item_id)
            if item is not None:
                item.text = resp.transcript[:chars]
        if (self.config.playback_commit_policy == "ack_only" and entry.done
                and entry.committed_ms >= entry.generated_ms):
            entry.history_final = True

    def item_retrieve(self, ev: ce.ConversationItemRetrieve) -> None:
        item = self._history_item(ev.item_id)
        self.emit(se.ItemRetrieved(item=item.to_json()).model_dump())

    def item_delete(self, ev: ce.ConversationItemDelete) -> None:
        item = self._history_item(ev.item_id)
        if self._active is not None and item.id == self._active.item_id:
            raise ProtocolError("bad_event", "cannot delete the active assistant item", param="item_id")
        self._history.delete(item.id)
        self.emit(se.ItemDeleted(item_id=item.id).model_dump())

    def _history_item(self, item_id: str | None):  # noqa: ANN202
        if item_id is None:
            raise ProtocolError("missing_item_id", "item_id is required", param="item_id")
        item = self._history.get(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"unknown item {item_id!r}", param="item_id")
        return item

    def event_ack(self, ev: ce.SessionEventAck) -> None:
        seq = ev.server_event_seq
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= self.last_seq:
            raise ProtocolError("invalid_event_ack", "server_event_seq must be an integer in [0, last seq]",
                                param="server_event_seq")
