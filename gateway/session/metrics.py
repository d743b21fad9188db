"""Response-scoped stage metrics (protocol.md §10.1).

Fed only with the per-unit timing snapshots the runtime attaches to `unit_done` of units owned by one
response (SM-1, SM-2). Expected `unit_done.metrics` layout (engine monotonic clock, ms):
  {"thinker": {"tokens": n, "ttft_ms": x, "token_times_ms": [t0, t1, ...]},
   "talker": {"first_output_ms": y, "from_unit_ms": y'}, "code2wav": {"first_output_ms": z, "from_unit_ms": z'},
   "unit_done": {"from_unit_ms": d}}
(first_output_ms from the stage's input, from_unit_ms from the unit's append: project additions, §10.1; so is each
stage's `from_unit_ms_by_unit`, one entry per owned unit in order (null where the stage gave none), stage "0" from
`unit_done`: where a unit's latency grows along a response)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_STAGES = (("1", "talker"), ("2", "code2wav"))


def summary(values: list[float]) -> dict[str, Any]:
    """{count, mean, p50, p95, max}; percentiles interpolate linearly between closest ranks (SM-4)."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    return {"count": len(values), "mean": round(float(arr.mean()), 3),
            "p50": round(float(np.percentile(arr, 50)), 3), "p95": round(float(np.percentile(arr, 95)), 3),
            "max": round(float(arr.max()), 3)}


class StageMetrics:
    def __init__(self) -> None:
        self.units = 0
        self.tokens = 0
        self.ttft_ms: float | None = None
        self._span_ms = 0.0
        self._span_div = 0
        self._itl: list[float] = []
        self._stage_units: dict[str, int] = {}
        self._first_output: dict[str, float] = {}
        self._from_unit: dict[str, float] = {}
        self._by_unit: dict[str, list[float | None]] = {"0": [], "1": [], "2": []}  # per owned unit, None: no time

    def _unit_time(self, key: str, stage: Mapping[str, Any] | None) -> None:
        ms = None if not stage or stage.get("from_unit_ms") is None else round(float(stage["from_unit_ms"]), 3)
        self._by_unit[key].append(ms)

    def add_unit(self, metrics: Mapping[str, Any]) -> None:
        self.units += 1
        thinker = metrics.get("thinker") or {}
        tokens = int(thinker.get("tokens", 0))
        self.tokens += tokens
        if self.units == 1 and thinker.get("ttft_ms") is not None:
            self.ttft_ms = float(thinker["ttft_ms"])
        times = [float(t) for t in thinker.get("token_times_ms", [])]
        if len(times) >= 2:
            # Intervals inside one unit only: a cross-unit gap includes waiting for input (§10.1 itl_ms).
            self._span_ms += times[-1] - times[0]
            self._span_div += len(times) - 1
            self._itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
        self._unit_time("0", metrics.get("unit_done"))
        for key, name in _STAGES:
            stage = metrics.get(name)
            self._unit_time(key, stage)
            if stage:
                self._stage_units[key] = self._stage_units.get(key, 0) + 1
                if key not in self._first_output and stage.get("first_output_ms") is not None:
                    self._first_output[key] = float(stage["first_output_ms"])
                    if stage.get("from_unit_ms") is not None:
                        self._from_unit[key] = float(stage["from_unit_ms"])

    def to_json(self, *, text_only: bool) -> dict[str, Any]:
        tpot = round(self._span_ms / self._span_div, 3) if self._span_div else None
        out: dict[str, Any] = {"0": {"stage": "thinker", "units": self.units, "num_generation_tokens": self.tokens,
                                     "ttft_ms": self.ttft_ms, "tpot_ms": tpot, "itl_ms": summary(self._itl)}}
        if not text_only:
            for key, name in _STAGES:
                if key in self._stage_units:
                    out[key] = {"stage": name, "units": self._stage_units[key],
                                "first_output_ms": self._first_output.get(key),
                                "from_unit_ms": self._from_unit.get(key)}
        for key, times in self._by_unit.items():
            if key in out and any(t is not None for t in times):
                out[key]["from_unit_ms_by_unit"] = list(times)
        return out
