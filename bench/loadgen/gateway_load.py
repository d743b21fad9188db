"""How loaded the gateway process was over a sweep step, from its own /metrics (gateway/observability.py).

- `cpu_share`: the process's CPU seconds over the step (`process_cpu_seconds_total`) per second of wall time. One
  asyncio process serves every session: near 1.0 it is at one core's limit.
- `loop_lag_ms`: how much later than asked its event loop ran a 100 ms timer (`duplex_event_loop_lag_seconds`,
  gateway/looplag.py), quantiles from the bucket deltas as text_wait.py reads them; every session's events wait
  that long. `over_50ms`: the share of probes that waited more than 50 ms.
"""

from __future__ import annotations

from typing import Any

from bench.loadgen import prom
from bench.loadgen.text_wait import quantile

LAG = "duplex_event_loop_lag_seconds"
CPU = "process_cpu_seconds_total"
MS = 1000.0
OVER_S = 0.05  # a bucket edge (gateway/observability.py LOOP_LAG_BUCKETS_S)
MEASURES = ("gateway process CPU seconds per wall second; its event loop's lag behind a 100 ms timer, "
            "bucket-interpolated")

Sample = dict[str, float]  # "cpu", "lag_sum", "lag_count", "lag_le_<edge>" -> value


def parse(text: str) -> Sample:
    out: Sample = {}
    for name, labels, value in prom.samples(text):
        if name == CPU:
            out["cpu"] = value
        elif name == LAG + "_bucket":
            out[f"lag_le_{labels['le']}"] = value
        elif name in (LAG + "_sum", LAG + "_count"):
            out["lag_" + name[len(LAG) + 1:]] = value
    return out


def figures(before: Sample | None, after: Sample | None, seconds: float) -> dict[str, Any]:
    empty = {"measures": MEASURES, "cpu_share": None,
             "loop_lag_ms": {"p50": None, "p99": None, "mean": None, "count": 0, "over_50ms": None}}
    if before is None or after is None:
        return empty
    cpu = after.get("cpu", 0.0) - before.get("cpu", 0.0) if "cpu" in after and "cpu" in before else None
    buckets = sorted((float(k[len("lag_le_"):]), v - before.get(k, 0.0))
                     for k, v in after.items() if k.startswith("lag_le_"))
    total = buckets[-1][1] if buckets else 0.0
    count = int(total)
    lag: dict[str, Any] = dict(empty["loop_lag_ms"])
    if total > 0:
        p50, p99 = quantile(buckets, 0.50), quantile(buckets, 0.99)
        within = next((cum for le, cum in buckets if abs(le - OVER_S) < 1e-9), None)
        lag = {"p50": None if p50 is None else round(p50 * MS, 1), "p99": None if p99 is None else round(p99 * MS, 1),
               "mean": round((after.get("lag_sum", 0.0) - before.get("lag_sum", 0.0)) / total * MS, 1),
               "count": count, "over_50ms": None if within is None else round(1 - within / total, 3)}
    return {"measures": MEASURES,
            "cpu_share": None if cpu is None or seconds <= 0 else round(cpu / seconds, 3), "loop_lag_ms": lag}
