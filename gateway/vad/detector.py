"""Server-VAD speech start/stop per session (protocol.md §8.1 `turn_detection`, §8.2 server VAD row).

`VadStream.feed` takes each append's resampled 16 kHz samples, runs whole 32 ms windows through the shared
model (a residual shorter than a window waits for the next append), and reports, on the input clock:

  * speech start on a confirmed onset (`onset_confirm_ms` of consecutive speech windows), with
    `audio_start_ms = onset - prefix_padding_ms`, never before the open item's start;
  * speech stop after `silence_duration_ms` of non-speech windows, `audio_end_ms` = end of the last
    speech window.

A window is speech iff its probability >= `threshold` (§8.2, no hysteresis).

`feed` runs the windows one ORT call each (one stream: tests, offline); `feed_batched` hands them to the
process's `VadBatcher` and awaits them (the served path). Both give the same probabilities, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.vad.model import SAMPLE_RATE_HZ, WINDOW_SAMPLES, SileroVad, VadState

if TYPE_CHECKING:
    from gateway.vad.batcher import VadBatcher

WINDOW_MS = 1000.0 * WINDOW_SAMPLES / SAMPLE_RATE_HZ  # 32 ms


@dataclass(frozen=True, slots=True)
class VadParams:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    onset_confirm_ms: int = 64  # server-owned: two windows, so one click never opens an utterance

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0 or self.prefix_padding_ms < 0 or self.silence_duration_ms <= 0 \
                or self.onset_confirm_ms <= 0:
            raise ValueError("invalid VAD parameters")

    @classmethod
    def from_turn_detection(cls, td: Mapping[str, Any], *, onset_confirm_ms: int = 64) -> VadParams:
        """From the validated `turn_detection` object (gateway.protocol.validate.check_turn_detection)."""
        return cls(float(td.get("threshold", 0.5)), int(td.get("prefix_padding_ms", 300)),
                   int(td.get("silence_duration_ms", 500)), onset_confirm_ms)


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    audio_start_ms: float  # onset - prefix padding, clamped to the item start
    onset_ms: float


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    audio_end_ms: float


@dataclass(frozen=True, slots=True)
class VadUpdate:
    events: tuple[SpeechStarted | SpeechStopped, ...]
    is_speech: bool  # a speech window, or inside an utterance; with VAD on this decides (§8.2 priority 1)
    onset_confirmed: bool  # a speech start was confirmed here: barge_in_on_speech barges in (§8.3 O4)
    probabilities: tuple[float, ...] = field(default=(), repr=False)


class VadStream:
    """Per-session detector; the model is shared, the state is this object's."""

    def __init__(self, model: SileroVad, params: VadParams, origin_ms: float = 0.0) -> None:
        self._model, self.params = model, params
        self._state: VadState = model.new_state()
        self._pending = np.zeros(0, np.float32)
        self._pos_ms = origin_ms  # input-clock time of the next unprocessed window
        self.active = False  # inside an utterance (between start and stop)
        self._run_start: float | None = None  # start of the current run of speech windows (not yet confirmed)
        self._run_ms = 0.0
        self._silence_ms = 0.0
        self._last_speech_end = origin_ms

    def reset(self, origin_ms: float) -> None:
        """Clear the utterance state and the model state (VAD turned on again, or a clear)."""
        self._state.reset()
        self._pending = np.zeros(0, np.float32)
        self._pos_ms, self._last_speech_end = origin_ms, origin_ms
        self.active, self._run_start, self._run_ms, self._silence_ms = False, None, 0.0, 0.0

    def feed(self, samples16k: np.ndarray, *, item_start_ms: float = 0.0) -> VadUpdate:
        buf, n = self._windows(samples16k)
        probs = self._model.probabilities(self._state, buf[:n * WINDOW_SAMPLES])
        return self._decide(buf, probs, item_start_ms)

    async def feed_batched(self, batcher: VadBatcher, samples16k: np.ndarray, *,
                           item_start_ms: float = 0.0) -> VadUpdate:
        """`feed` with the windows run in the batcher's rounds, among other sessions' windows."""
        buf, n = self._windows(samples16k)
        probs = await batcher.probabilities(self._state, buf[:n * WINDOW_SAMPLES].reshape(n, WINDOW_SAMPLES))
        return self._decide(buf, probs, item_start_ms)

    def _windows(self, samples16k: np.ndarray) -> tuple[np.ndarray, int]:
        """The residual and the new samples ([len] float32) and how many whole windows they hold."""
        buf = np.concatenate([self._pending, samples16k.astype(np.float32, copy=False)])  # [len]
        return buf, len(buf) // WINDOW_SAMPLES

    def _decide(self, buf: np.ndarray, probs: np.ndarray, item_start_ms: float) -> VadUpdate:
        """The windows' probabilities ([n]) -> speech events on the input clock; keeps the residual."""
        self._pending = buf[len(probs) * WINDOW_SAMPLES:].copy()
        events: list[SpeechStarted | SpeechStopped] = []
        any_speech, onset = self.active, False
        for p in probs:
            start, end = self._pos_ms, self._pos_ms + WINDOW_MS
            self._pos_ms = end
            if p >= self.params.threshold:
                any_speech = True
                onset |= self._speech_window(start, end, item_start_ms, events)
            else:
                self._silence_window(events)
        return VadUpdate(tuple(events), any_speech, onset, tuple(float(p) for p in probs))

    def _speech_window(self, start: float, end: float, item_start_ms: float, events: list) -> bool:
        self._last_speech_end, self._silence_ms = end, 0.0
        if self.active:
            return False
        if self._run_start is None:
            self._run_start, self._run_ms = start, 0.0
        self._run_ms += WINDOW_MS
        if self._run_ms < self.params.onset_confirm_ms:
            return False
        onset = self._run_start
        self.active, self._run_start = True, None
        events.append(SpeechStarted(max(onset - self.params.prefix_padding_ms, item_start_ms), onset))
        return True

    def _silence_window(self, events: list) -> None:
        self._run_start, self._run_ms = None, 0.0
        if not self.active:
            return
        self._silence_ms += WINDOW_MS
        if self._silence_ms >= self.params.silence_duration_ms:
            self.active, self._silence_ms = False, 0.0
            events.append(SpeechStopped(self._last_speech_end))
