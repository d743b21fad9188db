"""Server VAD in the session (protocol.md §8.1, §8.2): classification, speech events and the auto-commit.

The Silero model is one per process (the host hands in `vad_model`, loaded on first use); the recurrent
state is this session's `VadStream`. With VAD on, a chunk's speech verdict is the VAD's (priority 1),
`speech_started` / `speech_stopped` come from the detector on the input clock, and `speech_stopped` is
followed by the commit sequence Q1-Q4 exactly as an explicit commit (with `create_response` folded into the
effective `auto_response`). A VAD parameter change starts a fresh stream; turning VAD off drops it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gateway.protocol import server_events as se
from gateway.protocol.client_events import InputAudioBufferCommit
from gateway.protocol.errors import Effect, ProtocolError
from gateway.session.commits import CommitMixin
from gateway.vad.detector import SpeechStarted, VadParams, VadStream, VadUpdate
from gateway.vad.model import SileroVad

DEFAULT_ONSET_CONFIRM_MS = 64


class VadMixin(CommitMixin):
    vad: VadStream | None = None
    vad_model: Callable[[], SileroVad] | None = None  # the shared model; set by the host
    vad_onset_confirm_ms: int = DEFAULT_ONSET_CONFIRM_MS

    def sync_vad(self) -> None:
        """After open and after every `session.update`: match the detector to `turn_detection`."""
        td = self.config.turn_detection
        if td is None or self.vad_model is None:
            self.vad = None
            return
        params = VadParams.from_turn_detection(td, onset_confirm_ms=self.vad_onset_confirm_ms)
        if self.vad is None or self.vad.params != params:
            self.vad = VadStream(self.vad_model(), params, origin_ms=self._input_clock_ms)

    def vad_classify(self, samples16k: np.ndarray) -> VadUpdate | None:
        if self.vad is None:
            return None
        item_start = self._item_start_ms if self._item_id is not None else self._input_clock_ms
        return self.vad.feed(samples16k, item_start_ms=item_start)

    def on_vad_events(self, upd: VadUpdate) -> None:
        for ev in upd.events:
            if self._item_id is None:
                continue  # the item was closed meanwhile (commit/clear): the utterance has no item left
            if isinstance(ev, SpeechStarted):
                if not self._item_speech_started:
                    self._item_speech_started = True
                    self.emit(se.SpeechStarted(item_id=self._item_id, audio_start_ms=int(ev.audio_start_ms),
                                               metadata={"source": "server_vad", "epoch": self.epoch}).model_dump())
            elif self._item_speech_started:
                self._item_speech_started = False  # the commit below must not send a second speech_stopped
                self.emit(se.SpeechStopped(item_id=self._item_id, audio_end_ms=int(ev.audio_end_ms),
                                           metadata={"source": "server_vad", "epoch": self.epoch}).model_dump())
                self._auto_commit()

    def _auto_commit(self) -> None:
        """§8.2: Q1-Q4 follow `speech_stopped`. A refused commit (C9 backpressure) is reported; the item stays
        open and the next stop commits it."""
        try:
            self.commit(InputAudioBufferCommit(type="input_audio_buffer.commit"))
        except ProtocolError as err:
            err.effect = Effect.REPORT
            self.emit_error(err)

    def on_input_cleared(self) -> None:
        if self.vad is not None:
            self.vad.reset(self._input_clock_ms)
