"""Stateful per-session resampler to the model's 16 kHz input (protocol.md §9.2).

soxr keeps filter state across appends so chunk boundaries add no clicks; the stream is reset when
the input rate or format changes. 16 kHz input bypasses it.
"""

from __future__ import annotations

import numpy as np
import soxr

MODEL_RATE_HZ = 16000


class InputResampler:
    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._stream: soxr.ResampleStream | None = None

    def process(self, samples: np.ndarray, rate_hz: int, fmt: str) -> np.ndarray:
        """[n] float32 at `rate_hz` -> [m] float32 at 16 kHz."""
        if rate_hz == MODEL_RATE_HZ:
            self._key, self._stream = None, None
            return samples.astype(np.float32, copy=False)
        if self._key != (fmt, rate_hz) or self._stream is None:
            self._key = (fmt, rate_hz)
            self._stream = soxr.ResampleStream(rate_hz, MODEL_RATE_HZ, 1, dtype="float32", quality="HQ")
        return self._stream.resample_chunk(samples.astype(np.float32, copy=False), last=False)

    def flush(self) -> np.ndarray:
        """Drain the filter delay (on commit/final) so the item's tail reaches the model."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        out = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._key, self._stream = None, None
        return out
