"""`UnitFeed`: the input audio's way to the model — 16 kHz resampling, the input clock, unit cutting on the
fixed grid and submission to the runtime lane (protocol.md §8.6 U-1..U-7, §9.2, V-3).

It owns and alone writes the state below; the input track decides what to feed and when to flush.
"""

from __future__ import annotations

import numpy as np

from gateway.audio.resample import InputResampler
from gateway.runtime.base import UnitSubmission
from gateway.session.core import SessionCore
from gateway.session.response_track import ResponseTrack
from gateway.session.units import MODEL_RATE_HZ, CutUnit, UnitCutter, UnitGeometry


class UnitFeed:
    def __init__(self, core: SessionCore, responses: ResponseTrack, geometry: UnitGeometry) -> None:
        self.core, self.responses = core, responses
        self.cutter = UnitCutter(geometry)
        self._resampler = InputResampler()
        self.clock_ms = 0.0  # the input clock: 16 kHz audio accepted so far, in ms
        self._unsubmitted_bytes = 0
        self._force_next = False
        self._force_listen_remaining = core.config.force_listen_count
        self._frames_for_unit: dict[int, tuple[bytes, ...]] = {}

    def restore(self, *, next_unit: int, clock_ms: float) -> None:
        """An adopted session (gateway/session/snapshot.py): the model clock goes on where its earlier owner left
        it (unit 0 is longer than the others, so the unit index must not start again)."""
        self.cutter.next_index, self.clock_ms = next_unit, clock_ms
        self._force_listen_remaining = 0  # the opening's forced listens were spent by the earlier owner

    # ---- checks (no mutation) ----------------------------------------------------------------------------
    def can_take(self, wire_bytes: int) -> bool:
        return self.core.lane.can_reserve(self._unsubmitted_bytes + wire_bytes)

    # ---- audio in ------------------------------------------------------------------------------------------
    def resample(self, samples: np.ndarray, rate_hz: int, fmt: str) -> np.ndarray:
        """[n] float32 at `rate_hz` -> [m] float32 at 16 kHz (the resampler keeps its state between chunks)."""
        return self._resampler.process(samples, rate_hz, fmt) if len(samples) else samples

    def push(self, samples16k: np.ndarray, frames: tuple[bytes, ...], wire_bytes: int, now: float, *,
             force_listen: bool, final: bool) -> None:
        """Advance the input clock and submit every unit the chunk completes (`final`: the partial one too)."""
        self.clock_ms += len(samples16k) * 1000 / MODEL_RATE_HZ
        if frames:
            self._frames_for_unit[self.cutter.next_index] = frames  # V-3: last append before submission wins
        self._unsubmitted_bytes += wire_bytes
        if force_listen:
            self._force_next = True
        for unit in self.cutter.push(samples16k, now):
            self._submit(unit)
        if final:
            self.flush_residual()

    def flush_residual(self, commit_ids: tuple[int, ...] = ()) -> int | None:
        """Pad and submit the partial unit (final / commit). Returns the unit index, if one was submitted."""
        tail = self._resampler.flush()
        for unit in self.cutter.push(tail, self.core.clock()):
            self._submit(unit)
        unit = self.cutter.pad(allow_empty=False)
        if unit is None:
            return None
        self._submit(unit, commit_ids=commit_ids)
        self.cutter.arm_tick(self.core.clock())  # the next unit ends on the shared tick (when aligning)
        return unit.index

    def drop_partial(self) -> None:
        """Drop the audio not yet in a submitted unit (clear, non-speech commit)."""
        self.cutter.drop_partial()
        self._resampler.flush()
        self._unsubmitted_bytes = 0

    def tick(self, now: float) -> None:
        """The shared tick's short unit when no audio reached it; U-3: complete the unit with silence at its
        deadline."""
        for unit in self.cutter.cut_if_tick(now):
            self._submit(unit)
        deadline = self.cutter.deadline()
        if deadline is not None and now >= deadline:
            unit = self.cutter.pad(allow_empty=True)
            if unit is not None:
                self._submit(unit, synthetic=True)

    def reanchor(self) -> None:
        """Silence continuation starts: a late grid is re-anchored so the partial unit fills in real time."""
        self.cutter.reanchor_if_late(self.core.clock())

    # ---- the force-listen hold ---------------------------------------------------------------------------
    def force_next_listen(self) -> None:
        self._force_next = True

    def reset_force_listen(self, count: int) -> None:
        self._force_listen_remaining = count

    # ---- submission ----------------------------------------------------------------------------------------
    def _submit(self, unit: CutUnit, *, commit_ids: tuple[int, ...] = (), synthetic: bool = False) -> None:
        # U-7: with auto_response off the hold is released only for a response the client asked for
        # (awaiting its decision, or speaking its turn).
        forced = self._force_next or self._force_listen_remaining > 0 or (
            not self.core.config.effective_auto_response and self.responses.active is None)
        self._force_next = False
        if self._force_listen_remaining > 0:
            self._force_listen_remaining -= 1
        frames = self._frames_for_unit.pop(unit.index, ())
        self._frames_for_unit = {k: f for k, f in self._frames_for_unit.items() if k > unit.index}
        wire, self._unsubmitted_bytes = (0, self._unsubmitted_bytes) if synthetic else (self._unsubmitted_bytes, 0)
        self.core.lane.submit(UnitSubmission(unit.index, unit.samples.astype("<f4").tobytes(), frames, forced,
                                             synthetic, self.unit_temperature()), wire, commit_ids)

    def unit_temperature(self) -> float | None:
        """§2.8: the thinker temperature of the response that owns the unit being submitted, if it differs from
        the session's. The owner is the response active when the unit is cut (as for the U-7 hold above): the
        unit's own decision is not known before the runtime samples it."""
        active = self.responses.active
        t = active.options.temperature if active is not None else None
        return None if t is None or t == self.core.config.temperature else t
