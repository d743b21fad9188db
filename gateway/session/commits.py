"""Commit, clear and input.cancel transitions (protocol.md §3.1, §3.7 commit table, T-2)."""

from __future__ import annotations

from gateway.protocol import server_events as se
from gateway.protocol.client_events import InputAudioBufferCommit
from gateway.protocol.config import response_defaults
from gateway.protocol.errors import Effect, ProtocolError
from gateway.runtime.base import RUNTIME_DEAD, map_runtime_code
from gateway.session.inputs import InputMixin
from gateway.session.lane import AppendAcked, AppendFailed, CancelFailed, LaneResult
from gateway.session.view import turn_state


class CommitMixin(InputMixin):
    _commit_seq = 0

    def check_commit(self, response_create: bool | None) -> None:
        """Rows checked before any effect, in the order of §3.7: C6, C9, response_already_active."""
        if self._item_id is None or not self._item_has_audio:
            raise ProtocolError("input_audio_buffer_empty", "commit with no audio since the last commit")
        if self._pending_turns >= self.limits.max_pending_turns:
            raise ProtocolError("input_backpressure", "too many pending commits")
        if response_create and self._active is not None:
            raise ProtocolError("response_already_active", "a response is already active")

    def commit(self, ev: InputAudioBufferCommit) -> None:
        self.check_commit(ev.response_create)
        if ev.is_speech is False:  # C5
            self.cutter.drop_partial()
            self._resampler.flush()
            self._unsubmitted_bytes = 0
            item, prev, start, end = self.add_user_item()
            self.commit_events(item, prev, start, end, reason="non_speech", no_response=True)
            self.emit_listen(None, "non_speech_commit", None)
            return
        if ev.response_create:  # C8
            self._final_append(ev.final)
            item = self._committed(None)
            self.open_response("response_create", response_defaults(self.config), precreated=True,
                               input_item_id=item)
        elif not self.config.effective_auto_response or self._active is None:  # C1, C2
            self._final_append(ev.final)
            self._committed(None)
        elif self.overlap.overlap_ms <= self.config.overlap_short_ack_ms:  # C3
            self.emit(se.OverlapDecision(session_id=self.session_id, epoch=self.epoch, response_id=self._active.id,
                                         policy=self.config.effective_overlap_policy, action="drop",
                                         reason="short_overlap_ack",
                                         metadata={"overlap_ms": int(self.overlap.overlap_ms), "buffer_audio": False,
                                                   "defer_runtime_append": False, "force_listen": False}
                                         ).model_dump())
            item, prev, start, end = self.add_user_item()
            self.commit_events(item, prev, start, end, reason="short_overlap_ack", no_response=True)
        else:  # C4: one deferred commit, merged, promoted after the active response's R8
            item, prev, start, end = self.add_user_item()
            self._deferred_item = item
            self.commit_events(item, prev, start, end, reason="deferred", deferred=True)
        self.overlap.end()

    def _committed(self, reason: str | None) -> str:
        item, prev, start, end = self.add_user_item()
        self._committed_unconsumed.append(item)
        self.commit_events(item, prev, start, end)
        return item

    def _final_append(self, final: bool) -> None:
        """The item's final append: residual padded (final:true) and submitted; U-3 until the decision."""
        self._commit_seq += 1
        unit = self.flush_residual((self._commit_seq,)) if final else None
        if unit is not None:
            self._pending_turns += 1
        last = unit if unit is not None else self.cutter.next_index - 1
        self._awaiting_unit = last if last >= 0 else None
        if self._awaiting_unit is not None:
            self.on_silence_continuation_start()

    def after_terminal(self) -> None:
        if turn_state(self) != "assistant_playing":  # §8.3: a still-playing response keeps the episode
            self.overlap.end()
        if self._deferred_item is not None and self.state == "open":
            item, self._deferred_item = self._deferred_item, None
            self._final_append(True)
            self._committed_unconsumed.append(item)
            self._promoted_commit_pending = True

    def clear(self, reason: str) -> str | None:
        """Drop the open item's unsubmitted audio; returns its id."""
        item = self._item_id
        self.cutter.drop_partial()
        self._resampler.flush()
        self._unsubmitted_bytes = 0
        self._item_id, self._item_has_audio, self._item_speech_started = None, False, False
        self.overlap.end()
        self.on_input_cleared()
        return item

    def input_clear(self) -> None:
        item = self.clear("clear")
        self.emit(se.InputCleared(metadata={"epoch": self.epoch, "item_id": item, "reason": "clear"}).model_dump())

    def input_cancel(self) -> None:
        """Always advances the epoch exactly once (T-2), with or without an active response."""
        if not self.cancel_active("input_cancelled", cleared=False):
            self.advance_epoch()
        self._deferred_item = None
        self._promoted_commit_pending = False
        for commit_ids in self.lane.drop_queued():
            self._pending_turns -= len(commit_ids)
        self._awaiting_unit = None
        item = self.clear("input_cancel")
        self.emit(se.InputCleared(metadata={"epoch": self.epoch, "item_id": item, "reason": "input_cancel"}
                                  ).model_dump())

    def on_lane(self, result: LaneResult) -> None:
        if isinstance(result, CancelFailed):
            self.emit_error(ProtocolError("runtime_signal_failed", f"{result.code}: {result.message}"))
            return
        self._pending_turns -= len(result.commit_ids)
        if isinstance(result, AppendAcked) or self.state != "open":
            return
        # stale input is expected after a cancellation and is never reported (§4.4); an append failed by the
        # runtime stream's end is not either: that end closes the session with `runtime_dead`, reported once
        if isinstance(result, AppendFailed) and result.code not in ("stale_fence", RUNTIME_DEAD):
            code = map_runtime_code("append", result.code)
            self.fail_or_report(ProtocolError(code, f"{result.code}: {result.message}",
                                              effect=Effect.REPORT if code == "runtime_backpressure" else None))

    def on_input_cleared(self) -> None: ...
