"""`SessionCore`: the state and response lifecycle of the `DuplexSession` aggregate root.

All state lives here and changes only through these transition methods, called from the one session
actor (client events, runtime events, lane results and deadline ticks arrive on one queue). Canonical
`ga` events go to the outbox; the writer projects and sends them.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.audio.codec import encode_output, pcm16_duration_ms
from gateway.protocol import server_events as se
from gateway.protocol.config import ConfigContext, ResponseOptions, SessionConfig
from gateway.protocol.errors import Effect, ProtocolError, error_event
from gateway.runtime.base import Fence, Runtime, SessionKey
from gateway.session import ids
from gateway.session.history import ConversationRecord, HistoryItem
from gateway.session.history_commit import commit_history
from gateway.session.lane import RuntimeLane
from gateway.session.outbox import Kind, Outbox, OutboxOverflow, OutItem
from gateway.session.playback import PlaybackEntry
from gateway.session.responses import Response
from gateway.session.units import UnitCutter

Json = dict[str, Any]

# §3.2 status table: duplex.reason -> status_details.reason for client-caused cancellations.
_CLIENT_REASONS = frozenset({"client_cancelled", "barge_in", "output_cleared", "input_cancelled", "truncated"})


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_pending_input_bytes: int
    max_pending_turns: int
    runtime_timeout_s: float
    close_ack_timeout_s: float
    idle_ttl_s: float | None


@dataclass(slots=True)
class UnitOutput:
    """Output the runtime produced for one model unit, held until `unit_done` pairs it (C-3)."""
    speak: bool = False
    text: list[str] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)


class SessionCore:
    def __init__(self, *, session_id: str, incarnation: int, config: SessionConfig, ctx: ConfigContext,
                 limits: SessionLimits, runtime: Runtime, key: SessionKey, outbox: Outbox, lane: RuntimeLane,
                 cutter: UnitCutter, runtime_config: Json, clock: Callable[[], float]) -> None:
        self.session_id, self.incarnation = session_id, incarnation
        self.config, self.ctx, self.limits = config, ctx, limits
        self.runtime, self.key, self.outbox, self.lane, self.cutter = runtime, key, outbox, lane, cutter
        self.runtime_config, self.config_generation = runtime_config, 1
        self.clock = clock
        self.state = "open"
        self.epoch = 0
        self.model_turn_id = 0
        self._active: Response | None = None
        self._responses: dict[str, Response] = {}
        self._history = ConversationRecord()
        self.seq_source: Callable[[], int] = lambda: 0  # the writer's highest assigned server_event_seq
        self._dead_responses: set[str] = set()
        self._completed: set[str] = set()
        self._last_audio_response: str | None = None
        self._units: dict[int, UnitOutput] = {}
        self._drop_turn_output = False  # a gateway-forced turn close waits for the runtime's listen unit
        self._precreated_waiting = False
        self._force_listen_remaining = config.force_listen_count

    # ---- views read by the writer and the session object -------------------------------------------------
    @property
    def fence(self) -> Fence:
        return Fence(self.incarnation, self.epoch)

    @property
    def last_seq(self) -> int:
        return self.seq_source()

    @property
    def prefix_committed(self) -> bool:
        return self.lane.acked_appends > 0

    def is_stale(self, item: OutItem) -> bool:
        """S-1 at send time. A completed response's own queued deltas are never stale."""
        if item.kind is not Kind.STREAM:
            return False  # T-4: terminals and other events are always sent
        if item.response_id in self._dead_responses:
            return True
        return item.epoch is not None and item.epoch < self.epoch and item.response_id not in self._completed

    # ---- emission --------------------------------------------------------------------------------------
    def emit(self, *events: Json, kind: Kind = Kind.NORMAL, reserved: bool = False, **meta: Any) -> None:
        try:
            self.outbox.put(OutItem(events=tuple(events), kind=kind, **meta), reserved=reserved)
        except OutboxOverflow as exc:
            raise ProtocolError("output_buffer_overflow", str(exc), effect=Effect.CLOSE_SESSION) from None

    def emit_error(self, err: ProtocolError, client_event_id: str | None = None) -> None:
        """A sequenced error (fail-response / report / close-session)."""
        self.emit(error_event(err, client_event_id), reserved=True)

    # ---- response lifecycle ----------------------------------------------------------------------------
    def open_response(self, trigger: str, options: ResponseOptions, *, precreated: bool,
                      input_item_id: str | None) -> Response:
        assert self._active is None, "C-1: one non-terminal response at a time"
        rid = ids.response_id()
        resp = Response(id=rid, item_id=ids.assistant_item_id(rid), trigger=trigger, epoch=self.epoch,
                        model_turn_id=self.model_turn_id, input_item_id=input_item_id,
                        previous_item_id=self._history.last_id, options=options, precreated=precreated)
        self._history.add(HistoryItem(resp.item_id, "assistant", "in_progress", text_only=options.text_only))
        self._active, self._responses[rid] = resp, resp
        self._precreated_waiting = precreated
        self.emit(*resp.opening_events(), response_id=rid)
        self.on_silence_continuation_start()
        return resp

    def speak(self, resp: Response, unit: int | None) -> None:
        resp.decision = "speak"
        self._precreated_waiting = False
        if not resp.spoke:
            resp.spoke = True
            self.emit(resp.speak_event(self.session_id, unit), kind=Kind.STREAM, epoch=resp.epoch,
                      response_id=resp.id, model_turn_id=resp.model_turn_id)
        self.consume_committed_input()

    def emit_unit(self, resp: Response, unit: int, out: UnitOutput, end_of_turn: bool,
                  unit_metrics: Json | None) -> None:
        text = "".join(out.text)
        if resp.options.text_only:
            if text:
                resp.transcript += text
                self.emit(resp.text_delta_event(text, unit), kind=Kind.STREAM, epoch=resp.epoch,
                          response_id=resp.id, model_turn_id=resp.model_turn_id, text=text)
            return
        pcm = b"".join(out.audio)
        dur = pcm16_duration_ms(len(pcm))
        wire, rate = encode_output(pcm, resp.options.output_format)
        entry = self._playback(resp)
        start = resp.audio_ms
        resp.audio_ms += dur
        resp.audio_deltas += 1
        resp.transcript += text
        mark = {"text_chars": len(resp.transcript), "audio_end_ms": resp.audio_ms}
        entry.marks.append((resp.audio_ms, len(resp.transcript)))
        entry.sent_ms = resp.audio_ms
        entry.generated_ms = max(entry.generated_ms, entry.sent_ms)  # per-piece rounding never breaks the order
        if entry.first_send_at is None:
            entry.first_send_at = self.clock()
        md = {"epoch": resp.epoch, "model_turn_id": resp.model_turn_id, "model_unit_index": unit,
              "end_of_turn": end_of_turn, "audio_start_ms": start, "audio_end_ms": resp.audio_ms,
              "audio_text_mark": mark}
        if unit_metrics:
            md["unit_metrics"] = unit_metrics
        self.emit(*resp.pair_events(base64.b64encode(wire).decode(), resp.options.output_format, rate, text, md),
                  kind=Kind.STREAM, epoch=resp.epoch, response_id=resp.id, model_turn_id=resp.model_turn_id,
                  audio_ms=dur, text=text)

    def _playback(self, resp: Response) -> PlaybackEntry:
        if resp.playback is None:
            resp.playback = PlaybackEntry(resp.id)
            self._last_audio_response = resp.id
        return resp.playback

    def finish(self, resp: Response, status: str, reason: str, *, error: Json | None = None) -> None:
        """Accept and apply a terminal for `resp` (T-1..T-4), then emit R5-R8 / K3-K9."""
        if resp.terminal:
            return  # C-2 / T-3: a second terminal is a no-op
        resp.terminal = True
        self._active = None
        self._precreated_waiting = False
        item_status = "completed" if status == "completed" else "incomplete"
        if status == "completed":
            self._completed.add(resp.id)
            details: Json = {"type": "completed"}
        elif status == "cancelled":
            details = {"type": "cancelled"}
            if reason in _CLIENT_REASONS or reason == "client_session_close":
                details["reason"] = "client_cancelled"
            elif reason == "turn_detected":
                details["reason"] = "turn_detected"
        elif status == "incomplete":
            self._completed.add(resp.id)
            details = {"type": "incomplete", "reason": "max_output_tokens"}
        else:
            details = {"type": "failed", "error": error or {}}
        reason = "session_close" if reason == "client_session_close" else reason
        committed = commit_history(resp, status, self._history, now=self.clock(),
                                   ack_only=self.config.playback_commit_policy == "ack_only")
        duplex = dict(resp.duplex(), decision=resp.decision, reason=reason, committed=committed)
        if resp.playback is not None:
            resp.playback.done = True
            duplex["playback"] = resp.playback.cursors()
        if resp.options.return_stage_metrics:
            duplex["stage_metrics"] = resp.metrics.to_json(text_only=resp.options.text_only)
        self.emit(*resp.terminal_events(status, details, item_status, duplex), reserved=True, response_id=resp.id)
        self.after_terminal()

    def cancel_active(self, reason: str, *, cleared: bool, k1: Json | None = None) -> bool:
        """§3.6 K0-K9 for the active response; returns False if there is none."""
        resp = self._active
        if resp is None:
            return False
        self.kill_stream(resp)
        self.advance_epoch()
        if resp.decision == "speak":
            self.close_turn()  # F-5: the runtime closes the turn; the next speech opens a new response
        if k1 is not None:
            self.emit(k1)
        if cleared:
            self.emit(se.OutputCleared(response_id=resp.id).model_dump(), reserved=True)
        self.finish(resp, "cancelled", reason)
        return True

    def kill_stream(self, resp: Response) -> None:
        """K0: delete the response's unsent deltas, so its done transcript equals what was really sent."""
        for it in self.outbox.purge_stream(resp.id):
            resp.transcript = resp.transcript[: len(resp.transcript) - len(it.text)] if it.text else resp.transcript
            if any(e["type"] == "response.output_audio.delta" for e in it.events):
                resp.audio_deltas -= 1
                resp.audio_ms -= it.audio_ms
            if any(e["type"] == "response.speak" for e in it.events):
                resp.spoke = False
        if resp.playback is not None:
            resp.playback.sent_ms = resp.audio_ms
            resp.playback.marks = [m for m in resp.playback.marks if m[0] <= resp.audio_ms]
        self._dead_responses.add(resp.id)

    def advance_epoch(self) -> None:
        """The only place the epoch moves; always paired with the runtime cancel (F-6)."""
        old = self.fence
        self.epoch += 1
        self._units.clear()
        self._drop_turn_output = False
        self.lane.cancel(old, old.next())

    def close_turn(self) -> None:
        self.model_turn_id += 1

    def fail_active(self, err: ProtocolError) -> None:
        """fail-response effect (§1.7): the error precedes the terminal sequence."""
        self.emit_error(err)
        resp = self._active
        if resp is not None:
            self.kill_stream(resp)
            self.finish(resp, "failed", err.code, error={"type": err.spec.cls.value, "code": err.code,
                                                         "message": err.message})

    # hooks implemented by the input side
    def after_terminal(self) -> None: ...
    def consume_committed_input(self) -> None: ...
    def on_silence_continuation_start(self) -> None: ...
