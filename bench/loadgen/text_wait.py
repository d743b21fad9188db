"""P13 from the gateway's Prometheus endpoint (gateway/observability.py `duplex_transcript_delay_seconds`).

The gateway observes, for every transcript / text delta it hands to a client's socket, how long the delta's text
waited since its first token was sampled by stage0 (label start="sampled": the engine's stamp, on this host's
clock) or, where that stamp cannot be compared, since the gateway received the token (start="received"). Scraped
before and after a sweep step; the step's quantiles come from the bucket deltas, interpolated inside a bucket as
Prometheus' `histogram_quantile` does, so they are as fine as the buckets (30 ms is an edge).
"""

from __future__ import annotations

from typing import Any

from bench.loadgen import prom

FAMILY = "duplex_transcript_delay_seconds"
MEASURES = ("token sampled by stage0 (or received by the gateway) -> its transcript/text delta handed to the "
            "client's socket, gateway histogram, bucket-interpolated")
RESPONSES = ("audio", "text")
STARTS = ("sampled", "received")
TARGET_S = 0.030  # targets.md P13
SCRAPE_TIMEOUT_S = 5.0
MS = 1000.0

Sample = dict[tuple[str, str, str], float]  # (response, start, le or "count"/"sum") -> value


def parse(text: str) -> Sample:
    out: Sample = {}
    for name, labels, value in prom.samples(text, FAMILY):
        field = name[len(FAMILY) + 1:]
        key = labels.get("le", "") if field == "bucket" else field
        out[(labels.get("response", ""), labels.get("start", ""), key)] = value
    return out


def _buckets(before: Sample, after: Sample, responses: tuple[str, ...]) -> list[tuple[float, float]]:
    """[(le, cumulative count over the interval)] summed over `responses` and both starts, ascending le."""
    edges: dict[float, float] = {}
    for (resp, start, key), value in after.items():
        if resp in responses and key not in ("count", "sum", "created"):
            le = float(key)  # "+Inf" parses to inf
            edges[le] = edges.get(le, 0.0) + value - before.get((resp, start, key), 0.0)
    return sorted(edges.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile (0..1) in seconds, linear inside its bucket; None without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lo  # past the last finite edge: that edge is all a histogram can say
            return lo + (le - lo) * (rank - below) / (cum - below) if cum > below else le
        lo, below = le, cum
    return lo


def _row(buckets: list[tuple[float, float]], sum_s: float) -> dict[str, Any]:
    """Quantiles as fine as the buckets; the mean is exact (Δsum / Δcount)."""
    total = buckets[-1][1] if buckets else 0.0
    p50, p99 = quantile(buckets, 0.50), quantile(buckets, 0.99)
    within = next((cum for le, cum in buckets if abs(le - TARGET_S) < 1e-9), None)
    return {"p50": None if p50 is None else round(p50 * MS, 1), "p99": None if p99 is None else round(p99 * MS, 1),
            "mean": round(sum_s / total * MS, 1) if total else None, "count": int(total),
            "within_30ms": round(within / total, 3) if total and within is not None else None}


def figures(before: Sample | None, after: Sample | None) -> dict[str, Any]:
    """`transcript_behind_generation_ms` of one sweep step: all deltas, then by response kind and by start."""
    if before is None or after is None:
        return {"measures": MEASURES, "p50": None, "p99": None, "mean": None, "count": 0, "within_30ms": None,
                "by_response": {r: None for r in RESPONSES}, "start": {s: 0 for s in STARTS}}

    def delta(resp: str, start: str, key: str) -> float:
        return after.get((resp, start, key), 0.0) - before.get((resp, start, key), 0.0)

    def row(responses: tuple[str, ...]) -> dict[str, Any]:
        return _row(_buckets(before, after, responses), sum(delta(r, s, "sum") for r in responses for s in STARTS))

    return {"measures": MEASURES, **row(RESPONSES), "by_response": {r: row((r,)) for r in RESPONSES},
            "start": {s: int(sum(delta(r, s, "count") for r in RESPONSES)) for s in STARTS}}
