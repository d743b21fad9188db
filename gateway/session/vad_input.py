"""Server VAD of one session (protocol.md §8.1, §8.2): the detector that follows `turn_detection`.

The Silero model is one per process (the host hands in a loader, used on first need); the recurrent state
is this session's `VadStream`. With VAD on, a chunk's speech verdict is the VAD's (priority 1) and
`speech_started` / `speech_stopped` come from the detector on the input clock; the input track turns them
into events and the auto-commit. A VAD parameter change starts a fresh stream; turning VAD off drops it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gateway.vad.detector import VadParams, VadStream, VadUpdate
from gateway.vad.model import SileroVad

DEFAULT_ONSET_CONFIRM_MS = 64


class ServerVad:
    def __init__(self) -> None:
        self.stream: VadStream | None = None
        self._model: Callable[[], SileroVad] | None = None  # the shared model; bound by the host
        self._onset_confirm_ms = DEFAULT_ONSET_CONFIRM_MS

    def bind(self, model: Callable[[], SileroVad] | None, onset_confirm_ms: int) -> None:
        self._model, self._onset_confirm_ms = model, onset_confirm_ms

    def sync(self, turn_detection: dict[str, Any] | None, origin_ms: float) -> None:
        """After open and after every `session.update`: match the detector to `turn_detection`."""
        if turn_detection is None or self._model is None:
            self.stream = None
            return
        params = VadParams.from_turn_detection(turn_detection, onset_confirm_ms=self._onset_confirm_ms)
        if self.stream is None or self.stream.params != params:
            self.stream = VadStream(self._model(), params, origin_ms=origin_ms)

    def classify(self, samples16k: np.ndarray, item_start_ms: float) -> VadUpdate | None:
        return None if self.stream is None else self.stream.feed(samples16k, item_start_ms=item_start_ms)

    def reset(self, origin_ms: float) -> None:
        if self.stream is not None:
            self.stream.reset(origin_ms)
