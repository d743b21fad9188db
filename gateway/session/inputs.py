"""`InputTrack`: the input side of a session — the open input item, commits, server-VAD speech events and
the overlap episode (protocol.md §3.1, §3.1.1, §3.7, §8); its audio goes to the model through its
`UnitFeed` (units, the input clock, the lane).

It owns and alone writes the state below. Validation happens before any mutation, so a rejected append or
commit leaves the session unchanged. It reads and drives the response side through the `ResponseTrack`
it is given (the active response, the epoch, the conversation record).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.audio.codec import b64decode, decode_audio, rms
from gateway.protocol import client_events as ce
from gateway.protocol import server_events as se
from gateway.protocol import validate as v
from gateway.protocol.config import SessionConfig, check_voice_source, response_defaults
from gateway.protocol.errors import Effect, ProtocolError
from gateway.runtime.base import RUNTIME_DEAD, map_runtime_code
from gateway.session import ids
from gateway.session.core import SessionCore
from gateway.session.history import HistoryItem
from gateway.session.lane import AppendAcked, AppendFailed, CancelFailed, LaneResult
from gateway.session.response_track import ResponseTrack
from gateway.session.unit_feed import UnitFeed
from gateway.session.units import UnitGeometry
from gateway.session.vad_input import ServerVad
from gateway.vad.detector import SpeechStarted, VadUpdate
from gateway.vad.overlap import OverlapEpisode


@dataclass(frozen=True, slots=True)
class PreparedAudio:
    samples16k: np.ndarray  # [n] float32 at 16 kHz
    wire_bytes: int
    frames: tuple[bytes, ...]
    is_speech: bool
    speech_source: str  # server_vad | client_hint | rms (§8.2)
    vad: VadUpdate | None = None  # the server VAD's verdict and speech events for this chunk


class InputTrack:
    def __init__(self, core: SessionCore, responses: ResponseTrack, geometry: UnitGeometry) -> None:
        self.core, self.responses = core, responses
        self.feed = UnitFeed(core, responses, geometry)
        self.vad = ServerVad()
        self.overlap = OverlapEpisode()  # §8.3 episode: overlap_ms and the last decision
        self.item_id: str | None = None  # the open input item
        self._item_start_ms = 0.0
        self._item_has_audio = False
        self.item_speech_started = False
        self._committed_unconsumed: list[str] = []
        self._deferred_item: str | None = None
        self.promoted_commit_pending = False
        self.pending_turns = 0
        self.awaiting_unit: int | None = None
        self._initial_text_pending = core.config.duplex_initial_user_text is not None
        self._commit_seq = 0

    # ---- host and config ---------------------------------------------------------------------------------
    def sync_vad(self) -> None:
        """After open and after every `session.update`: match the detector to `turn_detection`."""
        self.vad.sync(self.core.config.turn_detection, self.feed.clock_ms)

    def on_config(self, config: SessionConfig, touched: set[str]) -> None:
        """An accepted `session.update` (already swapped into the core): restart what it resets."""
        if "force_listen_count" in touched:
            self.feed.reset_force_listen(config.force_listen_count)
        if "duplex_initial_user_text" in touched:
            self._initial_text_pending = config.duplex_initial_user_text is not None
        if "turn_detection" in touched:
            self.sync_vad()

    # ---- validation (no mutation) ------------------------------------------------------------------------
    async def prepare_audio(self, ev: ce.InputAudioBufferAppend) -> PreparedAudio:
        """Validate and decode; with server VAD on, await the chunk's windows in the batched VAD round (the
        session actor waits here, so the session's events keep their order)."""
        config = self.core.config
        check_voice_source(config, self.core.ctx)
        fmt_raw = ev.format or ev.input_audio_format
        fmt = v.input_format(fmt_raw, "format") if fmt_raw else config.input_audio_format
        raw = b64decode(ev.audio) if ev.audio else b""
        frames = v.check_video_frames(ev.video_frames)
        if not raw and not frames:
            raise ProtocolError("bad_audio", "audio may be empty only with video_frames", param="audio")
        if ev.sample_rate_hz is not None:
            rate = ev.sample_rate_hz
        elif fmt.startswith("g711"):
            rate = v.G711_RATE
        else:
            rate = config.input_audio_sample_rate_hz
        decoded = decode_audio(raw, fmt, rate, rate_given=ev.sample_rate_hz is not None)
        wire = len(raw) + sum(len(f) for f in frames)
        if not self.feed.can_take(wire):
            raise ProtocolError("input_backpressure", "pending input bytes over the session limit")
        samples = decoded.samples
        if ev.is_speech is not None:
            speech = ev.is_speech
        else:
            speech = bool(len(samples)) and rms(samples) > config.overlap_silence_rms
        resampled = self.feed.resample(samples, decoded.rate_hz, fmt)
        item_start = self._item_start_ms if self.item_id is not None else self.feed.clock_ms
        vad = await self.vad.classify(resampled, item_start)
        if vad is not None:  # server VAD, when on, decides speech before the client's is_speech (§8.2 priority 1)
            return PreparedAudio(resampled, wire, frames, vad.is_speech, "server_vad", vad)
        return PreparedAudio(resampled, wire, frames, speech, "client_hint" if ev.is_speech is not None else "rms")

    # ---- audio -------------------------------------------------------------------------------------------
    def accept_audio(self, prep: PreparedAudio, *, force_listen: bool, final: bool, keep: bool = True) -> None:
        """Stream the chunk to the model; `keep=False` (overlap `drop`) leaves it out of the open item."""
        now = self.core.clock()
        if self.item_id is None:
            self.item_id = ids.user_item_id()
            self._item_start_ms = self.feed.clock_ms
            self._item_has_audio = False
            self.item_speech_started = False
        if keep:
            self._item_has_audio = self._item_has_audio or bool(len(prep.samples16k)) or bool(prep.frames)
        if keep and prep.is_speech and not self.item_speech_started and prep.vad is None:
            self.item_speech_started = True
            self.core.emit(se.SpeechStarted(item_id=self.item_id, audio_start_ms=int(self.feed.clock_ms),
                                            metadata={"source": prep.speech_source,
                                                      "epoch": self.responses.epoch}).model_dump())
        self.feed.push(prep.samples16k, prep.frames, prep.wire_bytes, now, force_listen=force_listen, final=final)
        if prep.vad is not None and prep.vad.events:
            self._on_vad_events(prep.vad)

    def on_tick(self, now: float) -> None:
        """U-3: complete the unit with silence at its deadline while a response or a commit awaits the model."""
        if self.core.state != "open" or (self.responses.active is None and self.awaiting_unit is None):
            return
        self.feed.tick(now)

    # ---- what the response side asks (the session's InputLink routes here) ---------------------------------
    def on_response_opened(self) -> None:
        self.feed.reanchor()

    def force_next_unit_listen(self) -> None:
        self.feed.force_next_listen()

    def on_unit_decided(self, unit: int) -> None:
        if self.awaiting_unit is not None and unit >= self.awaiting_unit:
            self.awaiting_unit = None

    def response_input_item(self) -> str | None:
        if self._committed_unconsumed:
            return self._committed_unconsumed[-1]
        return self.item_id

    def consume_committed_input(self) -> None:
        self._committed_unconsumed.clear()
        self._initial_text_pending = False
        self.promoted_commit_pending = False

    def has_unconsumed_input(self) -> bool:
        return bool(self._committed_unconsumed) or self._deferred_item is not None or self._initial_text_pending

    def after_terminal(self) -> None:
        if self.responses.phase(self.core.clock()) != "assistant_playing":
            self.overlap.end()  # §8.3: a still-playing response keeps the episode
        if self._deferred_item is not None and self.core.state == "open":
            item, self._deferred_item = self._deferred_item, None
            self._final_append(True)
            self._committed_unconsumed.append(item)
            self.promoted_commit_pending = True

    def drop_deferred(self) -> None:
        """At close: no deferred commit is promoted by the cancelled response's terminal."""
        self._deferred_item = None

    # ---- commits (§3.7 commit table) -----------------------------------------------------------------------
    def check_commit(self, response_create: bool | None) -> None:
        """Rows checked before any effect, in the order of §3.7: C6, C9, response_already_active."""
        if self.item_id is None or not self._item_has_audio:
            raise ProtocolError("input_audio_buffer_empty", "commit with no audio since the last commit")
        if self.pending_turns >= self.core.limits.max_pending_turns:
            raise ProtocolError("input_backpressure", "too many pending commits")
        if response_create and self.responses.active is not None:
            raise ProtocolError("response_already_active", "a response is already active")

    def commit(self, ev: ce.InputAudioBufferCommit) -> None:
        self.check_commit(ev.response_create)
        config, responses = self.core.config, self.responses
        if ev.is_speech is False:  # a non-speech commit clears the item, appends nothing (C5)
            self.feed.drop_partial()
            item, prev, start, end = self.add_user_item()
            self.commit_events(item, prev, start, end, reason="non_speech", no_response=True)
            responses.emit_listen(None, "non_speech_commit", None)
            return
        if ev.response_create:  # commit and precreate a response (C8)
            self._final_append(ev.final)
            item = self._committed()
            responses.open_response("response_create", response_defaults(config), precreated=True,
                                    input_item_id=item)
        elif not config.effective_auto_response or responses.active is None:  # a final append, nothing else (C1, C2)
            self._final_append(ev.final)
            self._committed()
        elif self.overlap.overlap_ms <= config.overlap_short_ack_ms:  # a short overlap is a backchannel (C3)
            self.core.emit(se.OverlapDecision(session_id=self.core.session_id, epoch=responses.epoch,
                                              response_id=responses.active.id,
                                              policy=config.effective_overlap_policy, action="drop",
                                              reason="short_overlap_ack",
                                              metadata={"overlap_ms": int(self.overlap.overlap_ms),
                                                        "buffer_audio": False, "defer_runtime_append": False,
                                                        "force_listen": False}).model_dump())
            item, prev, start, end = self.add_user_item()
            self.commit_events(item, prev, start, end, reason="short_overlap_ack", no_response=True)
        else:  # C4: one deferred commit, merged, promoted after the active response's R8
            item, prev, start, end = self.add_user_item()
            self._deferred_item = item
            self.commit_events(item, prev, start, end, reason="deferred", deferred=True)
        self.overlap.end()

    def _committed(self) -> str:
        item, prev, start, end = self.add_user_item()
        self._committed_unconsumed.append(item)
        self.commit_events(item, prev, start, end)
        return item

    def _final_append(self, final: bool) -> None:
        """The item's final append: residual padded (final:true) and submitted; U-3 until the decision."""
        self._commit_seq += 1
        unit = self.feed.flush_residual((self._commit_seq,)) if final else None
        if unit is not None:
            self.pending_turns += 1
        last = unit if unit is not None else self.feed.cutter.next_index - 1
        self.awaiting_unit = last if last >= 0 else None
        if self.awaiting_unit is not None:
            self.feed.reanchor()  # silence continuation starts, as for a response

    def add_user_item(self) -> tuple[str, str | None, float, float]:
        """Close the open item into history; returns (item_id, previous_item_id, start_ms, end_ms)."""
        assert self.item_id is not None
        item_id, start, end = self.item_id, self._item_start_ms, self.feed.clock_ms
        prev = self.responses.history.add(HistoryItem(item_id, "user", "completed", audio_ms=int(end - start)))
        self.item_id, self._item_has_audio = None, False
        return item_id, prev, start, end

    def commit_events(self, item_id: str, prev: str | None, start: float, end: float, *, reason: str = "committed",
                      deferred: bool = False, no_response: bool = False) -> None:
        """Q1-Q4 (preceded by speech_stopped when speech_started was sent for the item)."""
        responses, emit = self.responses, self.core.emit
        if self.item_speech_started:
            self.item_speech_started = False
            emit(se.SpeechStopped(item_id=item_id, audio_end_ms=int(end),
                                  metadata={"source": "client_hint", "epoch": responses.epoch}).model_dump())
        md = {"epoch": responses.epoch, "model_turn_id": responses.model_turn_id,
              "history_len": len(responses.history), "audio_start_ms": int(start), "audio_end_ms": int(end),
              "response_create_deferred": deferred, "no_response": no_response, "reason": reason}
        user = responses.history.get(item_id)
        assert user is not None
        evs = [se.InputCommitted(item_id=item_id, previous_item_id=prev, metadata=md).model_dump(),
               se.ItemAdded(previous_item_id=prev, item=user.to_json()).model_dump()]
        if self.core.config.input_audio_transcription is not None:
            evs.append(se.TranscriptionCompleted(item_id=item_id, usage={"type": "duration",
                                                                        "seconds": (end - start) / 1000}
                                                 ).model_dump())
        evs.append(se.ItemDone(previous_item_id=prev, item=user.to_json()).model_dump())
        emit(*evs)

    async def item_create(self, ev: ce.ConversationItemCreate) -> None:
        item = ev.item
        content = item.get("content") if isinstance(item, dict) else None
        parts = content if isinstance(content, list) else []
        if any(isinstance(p, dict) and p.get("type") == "input_text" for p in parts):
            raise ProtocolError("native_text_append_unsupported", "user text items are not supported",
                                param="item.content")
        if (item.get("type", "message") != "message" or item.get("role") != "user" or len(parts) != 1
                or not isinstance(parts[0], dict) or parts[0].get("type") != "input_audio"
                or not isinstance(parts[0].get("audio"), str)):
            raise ProtocolError("unsupported_item_type", "only a user message with one input_audio part",
                                param="item")
        if self.item_id is not None and self._item_has_audio:
            raise ProtocolError("bad_event", "an input item is open; commit or clear it first", param="item")
        if ev.previous_item_id is not None and ev.previous_item_id != self.responses.history.last_id:
            raise ProtocolError("bad_event", "previous_item_id must be the last item", param="previous_item_id")
        part = parts[0]
        append = ce.InputAudioBufferAppend(type="input_audio_buffer.append", audio=part["audio"],
                                           format=part.get("format"), sample_rate_hz=part.get("sample_rate_hz"))
        prep = await self.prepare_audio(append)
        if not len(prep.samples16k):
            raise ProtocolError("input_audio_buffer_empty", "the item holds no audio", param="item.content[0]")
        if self.pending_turns >= self.core.limits.max_pending_turns:
            raise ProtocolError("input_backpressure", "too many pending commits")
        self.accept_audio(prep, force_listen=False, final=False)
        self.commit(ce.InputAudioBufferCommit(type="input_audio_buffer.commit"))

    # ---- clear and cancel: input.cancel advances the epoch once (§3.1, T-2) --------------------------------
    def clear(self) -> str | None:
        """Drop the open item's unsubmitted audio; returns its id."""
        item = self.item_id
        self.feed.drop_partial()
        self.item_id, self._item_has_audio, self.item_speech_started = None, False, False
        self.overlap.end()
        self.vad.reset(self.feed.clock_ms)
        return item

    def input_clear(self) -> None:
        item = self.clear()
        self.core.emit(se.InputCleared(metadata={"epoch": self.responses.epoch, "item_id": item,
                                                 "reason": "clear"}).model_dump())

    def input_cancel(self) -> None:
        """Always advances the epoch exactly once (T-2), with or without an active response."""
        if not self.responses.cancel_active("input_cancelled", cleared=False):
            self.responses.advance_epoch()
        self._deferred_item = None
        self.promoted_commit_pending = False
        for commit_ids in self.core.lane.drop_queued():
            self.pending_turns -= len(commit_ids)
        self.awaiting_unit = None
        item = self.clear()
        self.core.emit(se.InputCleared(metadata={"epoch": self.responses.epoch, "item_id": item,
                                                 "reason": "input_cancel"}).model_dump())

    # ---- lane results ------------------------------------------------------------------------------------
    def on_lane(self, result: LaneResult) -> None:
        if isinstance(result, CancelFailed):
            self.core.emit_error(ProtocolError("runtime_signal_failed", f"{result.code}: {result.message}"))
            return
        self.pending_turns -= len(result.commit_ids)
        if isinstance(result, AppendAcked) or self.core.state != "open":
            return
        # stale input is expected after a cancellation and is never reported (§4.4); an append failed by the
        # runtime stream's end is not either: that end closes the session with `runtime_dead`, reported once
        if isinstance(result, AppendFailed) and result.code not in ("stale_fence", RUNTIME_DEAD):
            code = map_runtime_code("append", result.code)
            self.responses.fail_or_report(ProtocolError(code, f"{result.code}: {result.message}",
                                                        effect=Effect.REPORT if code == "runtime_backpressure"
                                                        else None))

    # ---- server VAD speech events (§8.2) -------------------------------------------------------------------
    def _on_vad_events(self, upd: VadUpdate) -> None:
        for ev in upd.events:
            if self.item_id is None:
                continue  # the item was closed meanwhile (commit/clear): the utterance has no item left
            if isinstance(ev, SpeechStarted):
                if not self.item_speech_started:
                    self.item_speech_started = True
                    self.core.emit(se.SpeechStarted(item_id=self.item_id, audio_start_ms=int(ev.audio_start_ms),
                                                    metadata={"source": "server_vad",
                                                              "epoch": self.responses.epoch}).model_dump())
            elif self.item_speech_started:
                self.item_speech_started = False  # the commit below must not send a second speech_stopped
                self.core.emit(se.SpeechStopped(item_id=self.item_id, audio_end_ms=int(ev.audio_end_ms),
                                                metadata={"source": "server_vad",
                                                          "epoch": self.responses.epoch}).model_dump())
                self._auto_commit()

    def _auto_commit(self) -> None:
        """§8.2: Q1-Q4 follow `speech_stopped`. A refused commit (C9 backpressure) is reported; the item stays
        open and the next stop commits it."""
        try:
            self.commit(ce.InputAudioBufferCommit(type="input_audio_buffer.commit"))
        except ProtocolError as err:
            err.effect = Effect.REPORT
            self.core.emit_error(err)
