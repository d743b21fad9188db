"""Distribution summaries (`{count, mean, p50, p95, max}`) and the gapless-player simulation of §10.2."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (§10.1 SM-4), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    return {"count": len(values), "mean": round(sum(values) / len(values), 3),
            "p50": round(percentile(values, 50), 3), "p95": round(percentile(values, 95), 3),
            "max": round(max(values), 3)}


@dataclass(frozen=True)
class Underruns:
    max_ms: float
    total_ms: float


def simulate_gapless_player(recv_ms: Sequence[float], dur_ms: Sequence[float]) -> Underruns:
    """start0 = recv0; start_i = max(recv_i, end_{i-1}); gap_i = max(0, recv_i - end_{i-1}) (§10.2)."""
    if len(recv_ms) != len(dur_ms):
        raise ValueError("one duration per received chunk")
    max_gap = total = 0.0
    end = None
    for recv, dur in zip(recv_ms, dur_ms, strict=True):
        if end is None:
            end = recv + dur
            continue
        gap = max(0.0, recv - end)
        max_gap, total = max(max_gap, gap), total + gap
        end = max(recv, end) + dur
    return Underruns(round(max_gap, 3), round(total, 3))


def played_ms_at(now_ms: float, recv_ms: Sequence[float], dur_ms: Sequence[float]) -> float:
    """Position a gapless player (same simulation) has reached at `now_ms`: what a client would ack."""
    played = 0.0
    end = None
    for recv, dur in zip(recv_ms, dur_ms, strict=True):
        start = recv if end is None else max(recv, end)
        if now_ms <= start:
            break
        played += min(dur, now_ms - start)
        end = start + dur
    return played
