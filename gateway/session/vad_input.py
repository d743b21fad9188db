"""Server VAD of one session (protocol.md §8.1, §8.2): the detector that follows `turn_detection`.

The Silero model is one per process, and so is the batcher that runs it across sessions (the host hands in a
loader, used on first need); the recurrent state is this session's `VadStream`. With VAD on, a chunk's speech
verdict is the VAD's (priority 1) and `speech_started` / `speech_stopped` come from the detector on the input
clock; the input track turns them into events and the auto-commit. A VAD parameter change starts a fresh
stream; turning VAD off drops it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gateway.vad.batcher import VadBatcher
from gateway.vad.detector import VadParams, VadStream, VadUpdate

DEFAULT_ONSET_CONFIRM_MS = 64


class ServerVad:
    def __init__(self) -> None:
        self.stream: VadStream | None = None
        self._load: Callable[[], VadBatcher] | None = None  # the shared batcher and model; bound by the host
        self._batcher: VadBatcher | None = None
        self._onset_confirm_ms = DEFAULT_ONSET_CONFIRM_MS

    def bind(self, batcher: Callable[[], VadBatcher] | None, onset_confirm_ms: int) -> None:
        self._load, self._onset_confirm_ms = batcher, onset_confirm_ms

    def sync(self, turn_detection: dict[str, Any] | None, origin_ms: float) -> None:
        """After open and after every `session.update`: match the detector to `turn_detection`."""
        if turn_detection is None or self._load is None:
            self.stream = None
            return
        params = VadParams.from_turn_detection(turn_detection, onset_confirm_ms=self._onset_confirm_ms)
        if self.stream is None or self.stream.params != params:
            self._batcher = self._load()
            self.stream = VadStream(self._batcher.model, params, origin_ms=origin_ms)

    async def classify(self, samples16k: np.ndarray, item_start_ms: float) -> VadUpdate | None:
        """The chunk's verdict, its windows run in the process's batched rounds; None with VAD off."""
        if self.stream is None:
            return None
        assert self._batcher is not None
        return await self.stream.feed_batched(self._batcher, samples16k, item_start_ms=item_start_ms)

    def reset(self, origin_ms: float) -> None:
        if self.stream is not None:
            self.stream.reset(origin_ms)
