"""The input side of the session: appends, unit submission, commits (protocol.md §3.1.1, §3.7, §8.6, §9).

Validation happens before any mutation, so a rejected append or commit leaves the session unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.audio.codec import b64decode, decode_audio
from gateway.audio.resample import InputResampler
from gateway.protocol import server_events as se
from gateway.protocol import validate as v
from gateway.protocol.client_events import InputAudioBufferAppend
from gateway.protocol.config import check_voice_source
from gateway.protocol.errors import ProtocolError
from gateway.runtime.base import UnitSubmission
from gateway.session import ids
from gateway.session.history import HistoryItem
from gateway.session.output import OutputMixin
from gateway.session.units import MODEL_RATE_HZ, CutUnit
from gateway.vad.detector import VadUpdate
from gateway.vad.overlap import OverlapEpisode

BARGE_IN_ACTIONS = frozenset({"barge_in", "interrupt", "cancel"})


@dataclass(frozen=True, slots=True)
class PreparedAudio:
    samples16k: np.ndarray  # [n] float32 at 16 kHz
    wire_bytes: int
    frames: tuple[bytes, ...]
    is_speech: bool
    speech_source: str  # server_vad | client_hint | rms (§8.2)
    vad: VadUpdate | None = None  # the server VAD's verdict and speech events for this chunk


class InputMixin(OutputMixin):
    def init_input(self) -> None:
        self._resampler = InputResampler()
        self._input_clock_ms = 0.0
        self._item_id: str | None = None
        self._item_start_ms = 0.0
        self._item_has_audio = False
        self._item_speech_started = False
        self._unsubmitted_bytes = 0
        self._force_next = False
        self._frames_for_unit: dict[int, tuple[bytes, ...]] = {}
        self.overlap = OverlapEpisode()  # §8.3 episode: overlap_ms and the last decision
        self._committed_unconsumed: list[str] = []
        self._deferred_item: str | None = None
        self._promoted_commit_pending = False
        self._pending_turns = 0
        self._awaiting_unit: int | None = None
        self._initial_text_pending = self.config.duplex_initial_user_text is not None

    # ---- validation (no mutation) ------------------------------------------------------------------------
    def prepare_audio(self, ev: InputAudioBufferAppend) -> PreparedAudio:
        check_voice_source(self.config, self.ctx)
        fmt_raw = ev.format or ev.input_audio_format
        fmt = v.input_format(fmt_raw, "format") if fmt_raw else self.config.input_audio_format
        raw = b64decode(ev.audio) if ev.audio else b""
        frames = v.check_video_frames(ev.video_frames)
        if not raw and not frames:
            raise ProtocolError("bad_audio", "audio may be empty only with video_frames", param="audio")
        if ev.sample_rate_hz is not None:
            rate = ev.sample_rate_hz
        elif fmt.startswith("g711"):
            rate = v.G711_RATE
        else:
            rate = self.config.input_audio_sample_rate_hz
        decoded = decode_audio(raw, fmt, rate, rate_given=ev.sample_rate_hz is not None)
        wire = len(raw) + sum(len(f) for f in frames)
        if not self.lane.can_reserve(self._unsubmitted_bytes + wire):
            raise ProtocolError("input_backpressure", "pending input bytes over the session limit")
        samples = decoded.samples
        if ev.is_speech is not None:
            speech = ev.is_speech
        else:
            speech = bool(len(samples)) and float(np.sqrt(np.mean(samples**2))) > self.config.overlap_silence_rms
        resampled = self._resampler.process(samples, decoded.rate_hz, fmt) if len(samples) else samples
        vad = self.vad_classify(resampled)
        if vad is not None:  # §8.2 priority 1
            return PreparedAudio(resampled, wire, frames, vad.is_speech, "server_vad", vad)
        return PreparedAudio(resampled, wire, frames, speech, "client_hint" if ev.is_speech is not None else "rms")

    # ---- transitions -------------------------------------------------------------------------------------
    def accept_audio(self, prep: PreparedAudio, *, force_listen: bool, final: bool, keep: bool = True) -> None:
        """Stream the chunk to the model; `keep=False` (overlap `drop`) leaves it out of the open item."""
        now = self.clock()
        if self._item_id is None:
            self._item_id = ids.user_item_id()
            self._item_start_ms = self._input_clock_ms
            self._item_has_audio = False
            self._item_speech_started = False
        if keep:
            self._item_has_audio = self._item_has_audio or bool(len(prep.samples16k)) or bool(prep.frames)
        if keep and prep.is_speech and not self._item_speech_started and prep.vad is None:
            self._item_speech_started = True
            self.emit(se.SpeechStarted(item_id=self._item_id, audio_start_ms=int(self._input_clock_ms),
                                       metadata={"source": prep.speech_source,
                                                 "epoch": self.epoch}).model_dump())
        dur_ms = len(prep.samples16k) * 1000 / MODEL_RATE_HZ
        self._input_clock_ms += dur_ms
        if prep.frames:
            self._frames_for_unit[self.cutter.next_index] = prep.frames  # V-3: last append before submission wins
        self._unsubmitted_bytes += prep.wire_bytes
        if force_listen:
            self._force_next = True
        for unit in self.cutter.push(prep.samples16k, now):
            self.submit_unit(unit)
        if final:
            self.flush_residual()
        if prep.vad is not None and prep.vad.events:
            self.on_vad_events(prep.vad)

    def flush_residual(self, commit_ids: tuple[int, ...] = ()) -> int | None:
        """Pad and submit the partial unit (final / commit). Returns the unit index, if one was submitted."""
        tail = self._resampler.flush()
        for unit in self.cutter.push(tail, self.clock()):
            self.submit_unit(unit)
        unit = self.cutter.pad(allow_empty=False)
        if unit is None:
            return None
        self.submit_unit(unit, commit_ids=commit_ids)
        return unit.index

    def submit_unit(self, unit: CutUnit, *, commit_ids: tuple[int, ...] = (), synthetic: bool = False) -> None:
        # U-7: with auto_response off the hold is released only for a response the client asked for
        # (awaiting its decision, or speaking its turn).
        forced = self._force_next or self._force_listen_remaining > 0 or (
            not self.config.effective_auto_response and self._active is None)
        self._force_next = False
        if self._force_listen_remaining > 0:
            self._force_listen_remaining -= 1
        frames = self._frames_for_unit.pop(unit.index, ())
        self._frames_for_unit = {k: f for k, f in self._frames_for_unit.items() if k > unit.index}
        wire, self._unsubmitted_bytes = (0, self._unsubmitted_bytes) if synthetic else (self._unsubmitted_bytes, 0)
        self.lane.submit(UnitSubmission(unit.index, unit.samples.astype("<f4").tobytes(), frames, forced,
                                        synthetic, self.unit_temperature()), wire, commit_ids)

    def unit_temperature(self) -> float | None:
        """§2.8: the thinker temperature of the response that owns the unit being submitted, if it differs from
        the session's. The owner is the response active when the unit is cut (as for the U-7 hold above): the
        unit's own decision is not known before the runtime samples it."""
        t = self._active.options.temperature if self._active is not None else None
        return None if t is None or t == self.config.temperature else t

    def on_tick(self, now: float) -> None:
        """U-3: complete the unit with silence at its deadline while a response or a commit awaits the model."""
        if self.state != "open" or (self._active is None and self._awaiting_unit is None):
            return
        deadline = self.cutter.deadline()
        if deadline is not None and now >= deadline:
            unit = self.cutter.pad(allow_empty=True)
            if unit is not None:
                self.submit_unit(unit, synthetic=True)

    def on_silence_continuation_start(self) -> None:
        self.cutter.reanchor_if_late(self.clock())

    def force_next_unit_listen(self) -> None:
        self._force_next = True

    def on_unit_decided(self, unit: int) -> None:
        if self._awaiting_unit is not None and unit >= self._awaiting_unit:
            self._awaiting_unit = None

    def response_input_item(self) -> str | None:
        if self._committed_unconsumed:
            return self._committed_unconsumed[-1]
        return self._item_id

    def consume_committed_input(self) -> None:
        self._committed_unconsumed.clear()
        self._initial_text_pending = False
        self._promoted_commit_pending = False

    def has_unconsumed_input(self) -> bool:
        return bool(self._committed_unconsumed) or self._deferred_item is not None or self._initial_text_pending

    def add_user_item(self) -> tuple[str, str | None, float, float]:
        """Close the open item into history; returns (item_id, previous_item_id, start_ms, end_ms)."""
        assert self._item_id is not None
        item_id, start, end = self._item_id, self._item_start_ms, self._input_clock_ms
        prev = self._history.add(HistoryItem(item_id, "user", "completed", audio_ms=int(end - start)))
        self._item_id, self._item_has_audio = None, False
        return item_id, prev, start, end

    def commit_events(self, item_id: str, prev: str | None, start: float, end: float, *, reason: str = "committed",
                      deferred: bool = False, no_response: bool = False) -> None:
        """Q1-Q4 (preceded by speech_stopped when speech_started was sent for the item)."""
        if self._item_speech_started:
            self._item_speech_started = False
            self.emit(se.SpeechStopped(item_id=item_id, audio_end_ms=int(end),
                                       metadata={"source": "client_hint", "epoch": self.epoch}).model_dump())
        md = {"epoch": self.epoch, "model_turn_id": self.model_turn_id, "history_len": len(self._history),
              "audio_start_ms": int(start), "audio_end_ms": int(end), "response_create_deferred": deferred,
              "no_response": no_response, "reason": reason}
        user = self._history.get(item_id)
        assert user is not None
        evs = [se.InputCommitted(item_id=item_id, previous_item_id=prev, metadata=md).model_dump(),
               se.ItemAdded(previous_item_id=prev, item=user.to_json()).model_dump()]
        if self.config.input_audio_transcription is not None:
            evs.append(se.TranscriptionCompleted(item_id=item_id, usage={"type": "duration",
                                                                        "seconds": (end - start) / 1000}
                                                 ).model_dump())
        evs.append(se.ItemDone(previous_item_id=prev, item=user.to_json()).model_dump())
        self.emit(*evs)

    # hooks implemented by the server-VAD side (gateway.session.vad_input)
    def vad_classify(self, samples16k: np.ndarray) -> VadUpdate | None: ...
    def on_vad_events(self, upd: VadUpdate) -> None: ...
