"""Runtime output -> response projection (protocol.md §3.4, §3.8, C-8, L1-L8).

Every runtime event is accepted only if its fence epoch is the session epoch (§3.9 T-2); output is
buffered per unit and released at `unit_done` as one audio/transcript pair (C-3).
"""

from __future__ import annotations

from gateway.audio.codec import pcm16_duration_ms as pcm16_ms
from gateway.protocol import server_events as se
from gateway.protocol.config import response_defaults
from gateway.protocol.errors import Effect, ProtocolError
from gateway.runtime.base import AudioPiece, Decision, RuntimeEvent, StreamError, TextPiece, UnitDone
from gateway.session.core import SessionCore, UnitOutput


class OutputMixin(SessionCore):
    def on_runtime(self, ev: RuntimeEvent) -> None:
        if ev.epoch != self.epoch or self.state != "open":
            return  # stale epoch: rejected at acceptance, nothing is sent (L6, S-1)
        if isinstance(ev, StreamError):
            self.fail_or_report(ProtocolError("runtime_stream_failed", f"{ev.code}: {ev.message}"))
            return
        buf = self._units.setdefault(ev.unit, UnitOutput())
        if isinstance(ev, Decision):
            buf.speak = ev.action == "speak"
            if buf.speak and not self._drop_turn_output:
                self._on_speak(ev.unit)
        elif isinstance(ev, TextPiece):
            buf.text.append(ev.text)
            resp = self._active
            if resp is not None and resp.spoke:
                resp.text_tokens += 1
        elif isinstance(ev, AudioPiece):
            buf.audio.append(ev.pcm16)
            resp = self._active
            if resp is not None and resp.playback is not None and not self._drop_turn_output:
                resp.playback.generated_ms += pcm16_ms(len(ev.pcm16))  # §7.1: before stale filtering
        elif isinstance(ev, UnitDone):
            self._units.pop(ev.unit, None)
            self._on_unit_done(ev, buf)

    def _on_speak(self, unit: int) -> None:
        resp = self._active
        if resp is None:
            trigger = "deferred_commit" if self._promoted_commit_pending else "model"
            resp = self.open_response(trigger, response_defaults(self.config), precreated=False,
                                      input_item_id=self.response_input_item())
        if resp.playback is None and not resp.options.text_only:
            self._playback(resp)
        self.speak(resp, unit)

    def _on_unit_done(self, ev: UnitDone, buf: UnitOutput) -> None:
        self.on_unit_decided(ev.unit)
        if ev.is_listen:
            self._on_listen_unit(ev)
            return
        if self._drop_turn_output:
            return  # output of a turn the gateway already closed (C-8)
        resp = self._active
        if resp is None or not resp.spoke:
            self._on_speak(ev.unit)
            resp = self._active
        assert resp is not None
        resp.metrics.add_unit(ev.metrics)
        self.emit_unit(resp, ev.unit, buf, ev.end_of_turn, dict(ev.metrics.get("thinker", {})) or None)
        cap = resp.options.max_output_tokens
        if ev.end_of_turn:
            self.close_turn()
            self.finish(resp, "completed", "turn_end")
        elif cap != "inf" and resp.text_tokens >= int(cap):
            # Token cap: the gateway closes the turn; the next unit is forced to listen (§2.2).
            self.close_turn()
            self._drop_turn_output = True
            self.force_next_unit_listen()
            self.finish(resp, "incomplete", "max_output_tokens")

    def _on_listen_unit(self, ev: UnitDone) -> None:
        if self._drop_turn_output:
            self._drop_turn_output = False  # the runtime has closed the turn we closed
            self.emit_listen(ev.unit, "force_listen", None)
            return
        resp = self._active
        if ev.end_of_turn and resp is not None and resp.spoke:
            self.close_turn()
            self.finish(resp, "completed", "turn_end")  # L8: the owning response completes first
            self.emit_listen(ev.unit, "empty_turn_end", None)
            return
        reason = "force_listen" if ev.forced else "model_listen"
        if resp is not None and resp.precreated and not resp.spoke:
            self.emit_listen(ev.unit, reason, resp.id)  # L4: terminal decision of a precreated response
            self.finish(resp, "completed", "model_listen")
            return
        self.emit_listen(ev.unit, reason, None)

    def emit_listen(self, unit: int | None, reason: str, response_id: str | None) -> None:
        self.emit(se.ResponseListen(session_id=self.session_id, epoch=self.epoch, model_turn_id=self.model_turn_id,
                                    model_unit_index=unit, response_id=response_id,
                                    response={"id": response_id, "status": "listening",
                                              "metadata": {"reason": reason}}).model_dump())

    def fail_or_report(self, err: ProtocolError) -> None:
        """fail-response while a response is active, else report (§1.7 effect column)."""
        if self._active is not None and err.effect in (Effect.FAIL_RESPONSE, Effect.CLOSE_SESSION):
            self.fail_active(err)
        else:
            self.emit_error(err)

    # hooks implemented by the input side
    _promoted_commit_pending: bool = False

    def response_input_item(self) -> str | None: ...
    def on_unit_decided(self, unit: int) -> None: ...
    def force_next_unit_listen(self) -> None: ...
