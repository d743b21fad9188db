"""`ResponseTrack`: the response side of a session — responses, epoch and model turn, playback entries,
the conversation record — and the projection of runtime output onto responses
(protocol.md §3.2, §3.4, §3.6, §3.8, §3.9, C-8, L1-L8).

It owns and alone writes the state below. Runtime events are accepted only if their fence epoch is the
session epoch (§3.9 T-2). Text leaves as it is generated: each text piece of a unit the active response owns
goes out at once as its own transcript (or text) delta (targets.md P13; on /v1/duplex an audio response's text
stays in its pairs). Audio is buffered per unit and released as audio/transcript pairs (C-3; the pair's
transcript is the unit's text not sent yet, mostly ""): a piece of audio that the runtime marks as not its
unit's last (one Token2Wav call of several) goes out at once, the rest at `unit_done`, which carries
`end_of_turn` and the unit's metrics. A speak unit that ends with no audio at all is 1 s of silence (model.md
§6.6), never an empty delta. What it needs from the input side it asks through `InputLink` (the
session routes those calls to its `InputTrack`), so neither track subclasses or imports the other's module for
these calls.
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.audio.codec import encode_output, pcm16_duration_ms
from gateway.protocol import server_events as se
from gateway.protocol.config import ResponseOptions, response_defaults
from gateway.protocol.errors import Effect, ProtocolError
from gateway.protocol.validate import OUTPUT_RATE_HZ
from gateway.runtime.base import (
    AudioPiece,
    Decision,
    Fence,
    RuntimeEvent,
    StreamError,
    TextPiece,
    UnitDone,
    text_started_at,
)
from gateway.session import ids
from gateway.session.core import SessionCore
from gateway.session.history import ConversationRecord, HistoryItem
from gateway.session.history_commit import commit_history
from gateway.session.outbox import Kind, OutItem
from gateway.session.playback import PlaybackEntry
from gateway.session.responses import Response

Json = dict[str, Any]

# §3.2 status table: duplex.reason -> status_details.reason for client-caused cancellations.
_CLIENT_REASONS = frozenset({"client_cancelled", "barge_in", "output_cleared", "input_cancelled", "truncated"})
# model.md §6.6: a speak unit with no audio of its own is 1 s of zeros, as a listen unit (24 kHz PCM16)
UNIT_SILENCE = bytes(2 * OUTPUT_RATE_HZ)


class InputLink(Protocol):
    """The input side as the response track sees it (an interface, implemented by the session's routing)."""

    @property
    def promoted_commit_pending(self) -> bool:
        """A deferred commit was promoted after the last terminal and no response has consumed it yet."""

    def response_input_item(self) -> str | None:
        """The user item a new response answers."""

    def consume_committed_input(self) -> None:
        """A response spoke: the committed input it answers is consumed."""

    def after_terminal(self) -> None:
        """A response reached its terminal (the overlap episode, a deferred commit's promotion)."""

    def on_response_opened(self) -> None:
        """A response opened: silence continuation starts (the unit grid is re-anchored if late)."""

    def on_unit_decided(self, unit: int) -> None:
        """The runtime decided `unit` (a commit awaiting it is answered)."""

    def force_next_unit_listen(self) -> None:
        """The gateway closed the turn: the next unit submitted is forced to listen."""


@dataclass(slots=True)
class UnitOutput:
    """Output the runtime produced for one model unit and not sent yet (C-3 pairs it)."""
    speak: bool = False
    text: list[str] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    text_at: float | None = None  # when its first text started on its way out (`text_started_at`; P13)
    text_sampled: bool = False  # `text_at` is the engine's sampling time, not the gateway's receipt
    sent_chars: int = 0  # its text already sent on its own, ahead of its audio
    audio_bytes: int = 0  # audio the runtime gave it, sent or not (none by its unit_done: §6.6 silence)


class ResponseTrack:
    def __init__(self, core: SessionCore, link: InputLink) -> None:
        self.core, self.link = core, link
        self.epoch = 0
        self.model_turn_id = 0
        self.active: Response | None = None
        self.by_id: dict[str, Response] = {}
        self.history = ConversationRecord()
        self.last_audio_response: str | None = None
        self._dead: set[str] = set()
        self._completed: set[str] = set()
        self._units: dict[int, UnitOutput] = {}
        self._drop_turn_output = False  # a gateway-forced turn close waits for the runtime's listen unit

    # ---- views -------------------------------------------------------------------------------------------
    def was_completed(self, response_id: str) -> bool:
        """The response ended completed or incomplete: its queued deltas are never stale (S-1)."""
        return response_id in self._completed

    def is_stale(self, item: OutItem) -> bool:
        """S-1 at send time. A completed response's own queued deltas are never stale."""
        if item.kind is not Kind.STREAM:
            return False  # T-4: terminals and other events are always sent
        if item.response_id in self._dead:
            return True
        return item.epoch is not None and item.epoch < self.epoch and item.response_id not in self._completed

    def last_audio(self) -> Response | None:
        return self.by_id.get(self.last_audio_response) if self.last_audio_response else None

    def phase(self, now: float) -> str | None:
        """The response half of `turn_state` (§8.5): generating, playing, or None."""
        if self.active is not None:
            return "assistant_generating"
        last = self.last_audio()
        if last is not None and last.playback is not None and last.playback.playing(now):
            return "assistant_playing"
        return None

    def restore(self, *, epoch: int, model_turn_id: int, history: list[HistoryItem], responses: list[Response],
                active: str | None, last_audio: str | None, completed: set[str]) -> None:
        """An adopted session (gateway/session/snapshot.py), before it runs: the state its earlier owner kept."""
        self.epoch, self.model_turn_id = epoch, model_turn_id
        for item in history:
            self.history.add(item)
        self.by_id = {resp.id: resp for resp in responses}
        self.active = self.by_id.get(active) if active is not None else None
        self.last_audio_response = last_audio if last_audio in self.by_id else None
        self._completed = set(completed)

    def cancel_orphan(self, reason: str, next_epoch: int) -> None:
        """Adoption (gateway/directory/adopt.py): the runtime was already moved to `next_epoch` by the new owner's
        cancel, so the epoch is set, not advanced through the lane; the response that was in flight when the
        earlier owner died, if any, ends cancelled with `reason` (what it generated after the last event the
        earlier owner journaled is lost)."""
        resp = self.active
        self.epoch = next_epoch
        self._units.clear()
        self._drop_turn_output = False
        if resp is None:
            return
        self.kill_stream(resp)
        if resp.decision == "speak":
            self.close_turn()  # F-5: the runtime's cancel closed the turn in the KV
        self.finish(resp, "cancelled", reason)

    # ---- response lifecycle ----------------------------------------------------------------------------
    def open_response(self, trigger: str, options: ResponseOptions, *, precreated: bool,
                      input_item_id: str | None) -> Response:
        assert self.active is None, "C-1: one non-terminal response at a time"
        rid = ids.response_id()
        resp = Response(id=rid, item_id=ids.assistant_item_id(rid), trigger=trigger, epoch=self.epoch,
                        model_turn_id=self.model_turn_id, input_item_id=input_item_id,
                        previous_item_id=self.history.last_id, options=options, precreated=precreated)
        self.history.add(HistoryItem(resp.item_id, "assistant", "in_progress", text_only=options.text_only))
        self.active, self.by_id[rid] = resp, resp
        self.core.emit(*resp.opening_events(), response_id=rid)
        self.link.on_response_opened()
        return resp

    def speak(self, resp: Response, unit: int | None) -> None:
        resp.decision = "speak"
        if not resp.spoke:
            resp.spoke = True
            self.core.emit(resp.speak_event(self.core.session_id, unit), kind=Kind.STREAM, epoch=resp.epoch,
                           response_id=resp.id, model_turn_id=resp.model_turn_id)
        self.link.consume_committed_input()

    def emit_unit(self, resp: Response, unit: int, out: UnitOutput, end_of_turn: bool,
                  unit_metrics: Json | None) -> None:
        """Send what `out` holds as one pair (or a text delta) and empty it; the unit may send more later."""
        if resp.options.text_only:
            if any(out.text):
                self._send_text(resp, unit, out)
            return
        text, text_at = "".join(out.text), out.text_at
        pcm = b"".join(out.audio)
        out.text, out.audio, out.text_at = [], [], None
        dur = pcm16_duration_ms(len(pcm))
        wire, rate = encode_output(pcm, resp.options.output_format)
        entry = self.playback(resp)
        start = resp.audio_ms
        resp.audio_ms += dur
        resp.audio_deltas += 1
        resp.transcript += text
        # §7.5: the text this audio covers is the transcript through this unit, not the later units' early text
        ahead = sum(o.sent_chars for u, o in self._units.items() if u > unit)
        mark = {"text_chars": len(resp.transcript) - ahead, "audio_end_ms": resp.audio_ms}
        entry.marks.append((resp.audio_ms, mark["text_chars"]))
        entry.sent_ms = resp.audio_ms
        entry.generated_ms = max(entry.generated_ms, entry.sent_ms)  # per-piece rounding never breaks the order
        if entry.first_send_at is None:
            entry.first_send_at = self.core.clock()
        md = {"epoch": resp.epoch, "model_turn_id": resp.model_turn_id, "model_unit_index": unit,
              "end_of_turn": end_of_turn, "audio_start_ms": start, "audio_end_ms": resp.audio_ms,
              "audio_text_mark": mark}
        if unit_metrics:
            md["unit_metrics"] = unit_metrics
        self.core.emit(*resp.pair_events(base64.b64encode(wire).decode(), resp.options.output_format, rate, text,
                                         md),
                       kind=Kind.STREAM, epoch=resp.epoch, response_id=resp.id, model_turn_id=resp.model_turn_id,
                       audio_ms=dur, text=text, text_at=text_at if text else None, text_sampled=out.text_sampled)

    def playback(self, resp: Response) -> PlaybackEntry:
        """The response's playback entry, made on its first audio (the last audio response from then on)."""
        if resp.playback is None:
            resp.playback = PlaybackEntry(resp.id)
            self.last_audio_response = resp.id
        return resp.playback

    def finish(self, resp: Response, status: str, reason: str, *, error: Json | None = None) -> None:
        """Accept and apply a terminal for `resp` (T-1..T-4), then emit R5-R8 / K3-K9."""
        if resp.terminal:
            return  # C-2 / T-3: a second terminal is a no-op
        resp.terminal = True
        self.active = None
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
        committed = commit_history(resp, status, self.history, now=self.core.clock(),
                                   ack_only=self.core.config.playback_commit_policy == "ack_only")
        duplex = dict(resp.duplex(), decision=resp.decision, reason=reason, committed=committed)
        if resp.playback is not None:
            resp.playback.done = True
            duplex["playback"] = resp.playback.cursors()
        if resp.options.return_stage_metrics:
            duplex["stage_metrics"] = resp.metrics.to_json(text_only=resp.options.text_only)
        self.core.emit(*resp.terminal_events(status, details, item_status, duplex), reserved=True,
                       response_id=resp.id)
        self.link.after_terminal()

    def cancel_active(self, reason: str, *, cleared: bool, k1: Json | None = None) -> bool:
        """§3.6 K0-K9 for the active response; returns False if there is none."""
        resp = self.active
        if resp is None:
            return False
        self.kill_stream(resp)
        self.advance_epoch()
        if resp.decision == "speak":
            self.close_turn()  # F-5: the runtime closes the turn; the next speech opens a new response
        if k1 is not None:
            self.core.emit(k1)
        if cleared:
            self.core.emit(se.OutputCleared(response_id=resp.id).model_dump(), reserved=True)
        self.finish(resp, "cancelled", reason)
        return True

    def kill_stream(self, resp: Response) -> None:
        """K0: delete the response's unsent deltas, so its done transcript equals what was really sent."""
        for it in self.core.outbox.purge_stream(resp.id):
            resp.transcript = resp.transcript[: len(resp.transcript) - len(it.text)] if it.text else resp.transcript
            if any(e["type"] == "response.output_audio.delta" for e in it.events):
                resp.audio_deltas -= 1
                resp.audio_ms -= it.audio_ms
            if any(e["type"] == "response.speak" for e in it.events):
                resp.spoke = False
        if resp.playback is not None:
            resp.playback.sent_ms = resp.audio_ms
            resp.playback.marks = [m for m in resp.playback.marks if m[0] <= resp.audio_ms]
        self._dead.add(resp.id)

    def advance_epoch(self) -> None:
        """The only place the epoch moves; always paired with the runtime cancel (F-6)."""
        old = Fence(self.core.incarnation, self.epoch)
        self.epoch += 1
        self._units.clear()
        self._drop_turn_output = False
        self.core.lane.cancel(old, old.next())

    def close_turn(self) -> None:
        self.model_turn_id += 1

    def fail_active(self, err: ProtocolError) -> None:
        """fail-response effect (§1.7): the error precedes the terminal sequence."""
        self.core.emit_error(err)
        resp = self.active
        if resp is not None:
            self.kill_stream(resp)
            self.finish(resp, "failed", err.code, error={"type": err.spec.cls.value, "code": err.code,
                                                         "message": err.message})

    def fail_or_report(self, err: ProtocolError) -> None:
        """fail-response while a response is active, else report (§1.7 effect column)."""
        if self.active is not None and err.effect in (Effect.FAIL_RESPONSE, Effect.CLOSE_SESSION):
            self.fail_active(err)
        else:
            self.core.emit_error(err)

    def emit_listen(self, unit: int | None, reason: str, response_id: str | None) -> None:
        self.core.emit(se.ResponseListen(session_id=self.core.session_id, epoch=self.epoch,
                                         model_turn_id=self.model_turn_id, model_unit_index=unit,
                                         response_id=response_id,
                                         response={"id": response_id, "status": "listening",
                                                   "metadata": {"reason": reason}}).model_dump())

    # ---- close ---------------------------------------------------------------------------------------
    def close_active(self, why: str) -> None:
        """At close the runtime close replaces the cancel (K0), so the epoch is not advanced here."""
        resp = self.active
        if resp is None:
            return
        self.kill_stream(resp)
        with contextlib.suppress(ProtocolError):  # a full outbound queue must not stop the cleanup
            self.finish(resp, "cancelled", why)

    def finalise_history(self) -> None:
        """At close: nothing more will be played, so the history commit of the last response is final."""
        for resp in self.by_id.values():
            entry = resp.playback
            if entry is None or entry.history_final or not resp.terminal:
                continue
            entry.history_final = True  # §7.3: truncate or close finalises the entry where it stands

    # ---- runtime output -> responses -------------------------------------------------------------------
    def on_runtime(self, ev: RuntimeEvent) -> None:
        if ev.epoch != self.epoch or self.core.state != "open":
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
            if ev.text and buf.text_at is None:
                buf.text_at, buf.text_sampled = text_started_at(ev, self.core.clock())
            resp = self.active
            if resp is not None and resp.spoke:
                resp.text_tokens += 1
                ahead = resp.options.text_only or self.core.ctx.text_ahead_of_audio
                if ev.text and ahead and self._owns(resp, buf):
                    self._send_text(resp, ev.unit, buf)
        elif isinstance(ev, AudioPiece):
            buf.audio.append(ev.pcm16)
            buf.audio_bytes += len(ev.pcm16)
            resp = self.active
            if resp is not None and resp.playback is not None and not self._drop_turn_output:
                resp.playback.generated_ms += pcm16_duration_ms(len(ev.pcm16))  # §7.1: before stale filtering
            # the unit's later pieces follow as they come; a call with no audio (Token2Wav's first call of a turn can
            # return none) sends nothing: an empty delta would be the client's first audio
            if ev.last is False and ev.pcm16 and resp is not None and self._streams(resp, buf):
                self.emit_unit(resp, ev.unit, buf, False, None)
        elif isinstance(ev, UnitDone):
            self._units.pop(ev.unit, None)
            self._on_unit_done(ev, buf)

    def _on_speak(self, unit: int) -> None:
        resp = self.active
        if resp is None:
            trigger = "deferred_commit" if self.link.promoted_commit_pending else "model"
            resp = self.open_response(trigger, response_defaults(self.core.config), precreated=False,
                                      input_item_id=self.link.response_input_item())
        if resp.playback is None and not resp.options.text_only:
            self.playback(resp)
        self.speak(resp, unit)

    def _owns(self, resp: Response, buf: UnitOutput) -> bool:
        """The unit spoke and the active response owns it: its output may leave before its `unit_done`."""
        return buf.speak and resp.spoke and not self._drop_turn_output

    def _streams(self, resp: Response, buf: UnitOutput) -> bool:
        """The unit's audio may leave before its `unit_done`."""
        return self._owns(resp, buf) and not resp.options.text_only

    def _send_text(self, resp: Response, unit: int, out: UnitOutput) -> None:
        """The unit's unsent text as one delta of its own (P13): a transcript delta, or a text delta."""
        text, text_at = "".join(out.text), out.text_at
        out.text, out.text_at = [], None
        out.sent_chars += len(text)
        resp.transcript += text
        event = (resp.text_delta_event(text, unit) if resp.options.text_only
                 else resp.transcript_delta_event(text, unit))
        self.core.emit(event, kind=Kind.STREAM, epoch=resp.epoch, response_id=resp.id,
                       model_turn_id=resp.model_turn_id, text=text, text_at=text_at, text_sampled=out.text_sampled)

    def _on_unit_done(self, ev: UnitDone, buf: UnitOutput) -> None:
        self.link.on_unit_decided(ev.unit)
        if ev.is_listen:
            self._on_listen_unit(ev)
            return
        if self._drop_turn_output:
            return  # output of a turn the gateway already closed (C-8)
        resp = self.active
        if resp is None or not resp.spoke:
            self._on_speak(ev.unit)
            resp = self.active
        assert resp is not None
        resp.metrics.add_unit(ev.metrics)
        if not buf.audio_bytes and not resp.options.text_only:
            self._silence(resp, buf)
        self.emit_unit(resp, ev.unit, buf, ev.end_of_turn, dict(ev.metrics.get("thinker", {})) or None)
        cap = resp.options.max_output_tokens
        if ev.end_of_turn:
            self.close_turn()
            self.finish(resp, "completed", "turn_end")
        elif cap != "inf" and resp.text_tokens >= int(cap):
            # Token cap: the gateway closes the turn; the next unit is forced to listen (§2.2).
            self.close_turn()
            self._drop_turn_output = True
            self.link.force_next_unit_listen()
            self.finish(resp, "incomplete", "max_output_tokens")

    def _silence(self, resp: Response, buf: UnitOutput) -> None:
        """A speak unit the runtime rendered no audio for is 1 s of silence (model.md §6.6), as a listen unit. A safety
        net: the runtime renders every speak unit, also one with no text rows (§3.7 Q11: the TTS runs from
        `audio_bos` alone), but a runtime that sends none must not make the pair an empty delta (as a response's
        first audio the client got zero bytes), and the response's audio keeps one second per unit."""
        buf.audio.append(UNIT_SILENCE)
        self.playback(resp).generated_ms += pcm16_duration_ms(len(UNIT_SILENCE))

    def _on_listen_unit(self, ev: UnitDone) -> None:
        if self._drop_turn_output:
            self._drop_turn_output = False  # the runtime has closed the turn we closed
            self.emit_listen(ev.unit, "force_listen", None)
            return
        resp = self.active
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
