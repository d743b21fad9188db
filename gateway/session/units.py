"""Model-unit framing of the 16 kHz input (protocol.md §8.6 U-1, U-3..U-6; §9.2 framing).

Unit 0 is 16,480 samples (1030 ms), later units 16,000 (1000 ms). Deadlines sit on a fixed grid:
deadline(k) = anchor + end of unit k on the model clock + grace; they are not chained to the previous
unit's completion. When silence continuation starts after a quiet spell the grid is re-anchored so the
partial unit fills in real time from now instead of being flushed at once.

With `align_period_s` > 0 the unit after a commit is cut short on the next shared tick (a multiple of the
period on the gateway clock), padded with silence like the commit's own unit, and the units after it follow
1 s apart from that tick: every session's units then reach the stages at the same moments of the second, so
each stage step batches them together instead of each session's unit arriving at its own phase. A unit on
that grid is complete when the client's chunk that passes its end arrives, up to one chunk period after the
end (200 ms for the load generator's chunks), at each session's own phase, and leaves then: holding it until
its grid end + 0.25 s was measured worse on the H200 (bench/RESULTS.md "Stop 30" item 3) and removed.

With `align_min_sessions` > 0 a commit arms the tick only while at least that many sessions are live on this
gateway (`live_sessions`): in phase, each stage's GPU time per second fell 40-49 % at 16 sessions on an H100 but
commit->first audio rose 213 -> 271 ms p50 (bench/RESULTS.md "Stop 52 on an H100"), so one profile can keep the unaligned
latency at low load and the batched steps at high load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

MODEL_RATE_HZ = 16000


@dataclass(frozen=True, slots=True)
class UnitGeometry:
    first_unit_samples: int = 16480
    unit_samples: int = 16000
    deadline_grace_s: float = 0.25  # NOTE: slack for client jitter before silence is injected
    align_period_s: float = 0.0  # > 0: units put on a shared tick after each commit (module docstring); 0: off
    align_min_sessions: int = 0  # > 0: align only while live_sessions() reaches it (module docstring)
    live_sessions: Callable[[], int] | None = field(default=None, compare=False)  # this gateway's live sessions

    def aligning(self) -> bool:
        """Whether a commit now puts the next unit on the shared tick (without a count, the period alone rules)."""
        live = self.live_sessions
        return self.align_period_s > 0 and (live is None or live() >= self.align_min_sessions)

    def length(self, k: int) -> int:
        return self.first_unit_samples if k == 0 else self.unit_samples

    def start(self, k: int) -> int:
        return 0 if k == 0 else self.first_unit_samples + (k - 1) * self.unit_samples

    def end_s(self, k: int) -> float:
        return (self.start(k) + self.length(k)) / MODEL_RATE_HZ


@dataclass(frozen=True, slots=True)
class CutUnit:
    index: int
    samples: np.ndarray  # [length(index)] float32, 16 kHz
    client_samples: int  # how many of them came from the client (the rest is padding)


class UnitCutter:
    def __init__(self, geometry: UnitGeometry) -> None:
        self.geometry = geometry
        self.next_index = 0
        self._buf = np.zeros(0, np.float32)
        self._client_in_buf = 0
        self._anchor: float | None = None
        self._tick_at: float | None = None  # the shared tick the partial unit is cut on (armed by a commit)

    @property
    def residual(self) -> int:
        return len(self._buf)

    @property
    def model_clock_ms(self) -> int:
        return (self.geometry.start(self.next_index) + len(self._buf)) * 1000 // MODEL_RATE_HZ

    def push(self, samples: np.ndarray, now: float) -> list[CutUnit]:
        """Append client audio; returns the units it completes. A chunk that reaches past an armed tick is split
        there: the audio up to the tick ends the short unit, the rest starts the next one."""
        if self._tick_at is not None and now >= self._tick_at:
            head = max(0, len(samples) - round((now - self._tick_at) * MODEL_RATE_HZ))
            return self._push(samples[:head], now) + self._cut_on_tick() + self._push(samples[head:], now)
        return self._push(samples, now)

    def arm_tick(self, now: float) -> None:
        """After a commit: the partial unit will end on the next shared tick (no-op when not aligning now)."""
        if self.geometry.aligning():
            period = self.geometry.align_period_s
            self._tick_at = (now // period + 1) * period

    def cut_if_tick(self, now: float) -> list[CutUnit]:
        """No audio past the armed tick came within the deadline grace: cut the partial unit on the tick now. (The
        chunk that passes the tick normally arrives first and is split there by `push`; cutting at the tick itself
        would end the unit at the last chunk before it, a whole chunk early.)"""
        due = self._tick_at is not None and now >= self._tick_at + self.geometry.deadline_grace_s
        return self._cut_on_tick() if due else []

    def _cut_on_tick(self) -> list[CutUnit]:
        tick, self._tick_at = self._tick_at, None
        assert tick is not None
        unit = self.pad(allow_empty=False)  # nothing since the last cut: the next unit already starts on the tick
        self._anchor = tick - self.geometry.start(self.next_index) / MODEL_RATE_HZ  # deadlines from the tick
        return [unit] if unit is not None else []

    def _push(self, samples: np.ndarray, now: float) -> list[CutUnit]:
        if self._anchor is None and len(samples):
            self._anchor = now - len(samples) / MODEL_RATE_HZ
        self._buf = np.concatenate([self._buf, samples.astype(np.float32, copy=False)])
        self._client_in_buf += len(samples)
        out: list[CutUnit] = []
        while len(self._buf) >= self.geometry.length(self.next_index):
            out.append(self._cut(self.geometry.length(self.next_index)))
        return out

    def pad(self, *, allow_empty: bool) -> CutUnit | None:
        """Complete the partial unit with silence (commit/final, or U-3 with `allow_empty`)."""
        if not len(self._buf) and not allow_empty:
            return None
        need = self.geometry.length(self.next_index) - len(self._buf)
        self._buf = np.concatenate([self._buf, np.zeros(need, np.float32)])
        return self._cut(len(self._buf))

    def drop_partial(self) -> int:
        """Forget not-yet-submitted audio (input_audio_buffer.clear); returns the dropped sample count."""
        n, self._buf, self._client_in_buf = len(self._buf), np.zeros(0, np.float32), 0
        return n

    def deadline(self) -> float | None:
        if self._anchor is None:
            return None
        return self._anchor + self.geometry.end_s(self.next_index) + self.geometry.deadline_grace_s

    def reanchor_if_late(self, now: float) -> None:
        """Start of silence continuation: if the grid is already past, restart it from now."""
        d = self.deadline()
        if d is None or d < now:
            self._anchor = now - (self.geometry.start(self.next_index) + len(self._buf)) / MODEL_RATE_HZ

    def _cut(self, n: int) -> CutUnit:
        unit, self._buf = self._buf[:n], self._buf[n:]
        client = min(self._client_in_buf, n)
        self._client_in_buf -= client
        cut = CutUnit(self.next_index, unit, client)
        self.next_index += 1
        return cut
