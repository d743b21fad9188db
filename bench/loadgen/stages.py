"""Stage metrics from Triton's Prometheus endpoint (model_repository/common/metrics.py writes them).

Scraped before and after a sweep step; the step's mean is Δsum / Δcount of each histogram per stage, so
earlier runs and warm-up do not blur it.
"""

from __future__ import annotations

import urllib.request

from bench.loadgen import prom

STAGES = ("stage0", "tts", "token2wav")
FAMILIES = {"rows_per_step": "duplex_stage_rows_per_step",
            "step_ms": "duplex_stage_step_seconds",
            "queue_wait_ms": "duplex_stage_queue_wait_seconds"}
SCALE = {"rows_per_step": 1.0, "step_ms": 1000.0, "queue_wait_ms": 1000.0}
# labelled by stage and kind (stage0: prefill / decode, and token: the steps that decoded tokens, their token rows)
KIND_FAMILIES = {"rows": "duplex_stage_kind_rows_per_step",
                 "step_ms": "duplex_stage_kind_step_seconds"}
SCRAPE_TIMEOUT_S = 5.0
SLOW_STEP_S = 0.25  # a histogram bucket edge (model_repository/common/metrics.py SECONDS_BUCKETS)

Sample = dict[tuple[str, str], float]  # (metric name, stage) -> value


def parse(text: str) -> Sample:
    """The duplex stage samples by stage: `*_sum`, `*_count`, the step histogram's buckets (keyed
    `name:le`), the by-kind histograms' sums and counts (keyed `name:kind`) and the graph-miss counter (summed
    over its kinds)."""
    out: Sample = {}
    for name, labels, value in prom.samples(text, "duplex_stage_"):
        stage = labels.get("stage")
        if name.endswith("_bucket"):
            if name != f"{FAMILIES['step_ms']}_bucket":
                continue
            name = f"{name}:{labels.get('le')}"
        elif name.startswith(tuple(KIND_FAMILIES.values())):
            name = f"{name}:{labels.get('kind')}"
        if stage is not None:
            key = (name, stage)
            out[key] = out.get(key, 0.0) + value  # summed over instances (other labels)
    return out


def scrape(url: str) -> Sample:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
        return parse(resp.read().decode())


def _delta(before: Sample, after: Sample, name: str, stage: str) -> float:
    return after.get((name, stage), 0.0) - before.get((name, stage), 0.0)


def tails(before: Sample, after: Sample) -> dict[str, dict[str, float | None]]:
    """{"step_p99_ms": {stage: the upper bound of the histogram bucket holding the 99th percentile},
    "slow_steps": {stage: steps over SLOW_STEP_S}, "graph_misses": {stage: calls with no prebuilt graph}}
    over the interval: where a stage stalls, which a mean hides."""
    bucket = f"{FAMILIES['step_ms']}_bucket:"
    out: dict[str, dict[str, float | None]] = {"step_p99_ms": {}, "slow_steps": {}, "graph_misses": {}}
    for stage in STAGES:
        edges = sorted((float(k[0][len(bucket):]), _delta(before, after, k[0], stage)) for k in after
                       if k[1] == stage and k[0].startswith(bucket))
        total = edges[-1][1] if edges else 0.0  # le="+Inf" sorts last
        p99 = next((le for le, cum in edges if cum >= 0.99 * total), None) if total > 0 else None
        out["step_p99_ms"][stage] = None if p99 is None else p99 * 1000.0
        below = next((cum for le, cum in edges if le == SLOW_STEP_S), None)
        out["slow_steps"][stage] = None if below is None else total - below
        out["graph_misses"][stage] = _delta(before, after, "duplex_stage_graph_misses_total", stage)
    return out


def means(before: Sample, after: Sample) -> dict[str, dict[str, float | None]]:
    """{"rows_per_step": {stage: mean}, "step_ms": {...}, "queue_wait_ms": {...}} over the interval."""
    out: dict[str, dict[str, float | None]] = {}
    for key, family in FAMILIES.items():
        out[key] = {}
        for stage in STAGES:
            d_sum, d_count = (_delta(before, after, f"{family}_{part}", stage) for part in ("sum", "count"))
            out[key][stage] = round(d_sum / d_count * SCALE[key], 3) if d_count > 0 else None
    return out


def busy(before: Sample, after: Sample, seconds: float) -> dict[str, float | None]:
    """{stage: ms of engine steps per second of the interval}: how much of the time each stage's engine thread
    was stepping (the stages' steps overlap on the device, so their sum can pass 1000)."""
    family = FAMILIES["step_ms"]
    return {stage: round(_delta(before, after, f"{family}_sum", stage) * 1000.0 / seconds, 1) if seconds > 0 else None
            for stage in STAGES}


def by_kind(before: Sample, after: Sample) -> dict[str, dict[str, dict[str, float]]]:
    """{stage: {kind: {"steps": n, "mean_rows": rows, "mean_ms": ms}}} over the interval, for the stages that tell
    what their steps ran (stage0: `prefill` steps ran the audio front end and a prefill pass, `decode` steps
    decoded tokens only; `token` is every step that decoded tokens, with its token rows: P12 reads these)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    rows, step = KIND_FAMILIES["rows"], KIND_FAMILIES["step_ms"]
    prefix = f"{step}_count:"
    for name, stage in sorted(k for k in after if k[0].startswith(prefix)):
        kind = name[len(prefix):]
        count = _delta(before, after, name, stage)
        if count > 0:
            out.setdefault(stage, {})[kind] = {
                "steps": count,
                "mean_rows": round(_delta(before, after, f"{rows}_sum:{kind}", stage) / count, 3),
                "mean_ms": round(_delta(before, after, f"{step}_sum:{kind}", stage) / count * 1000.0, 3)}
    return out


P12_SHARE = 0.8  # targets.md P12: rows per stage0 decode step >= 0.8 x the sessions speaking


def occupancy(by_kind: dict[str, dict[str, dict[str, float]]], audio_s: float, seconds: float) -> dict[str, object]:
    """P12 over a level: stage0's token rows per step that decoded tokens (`by_kind`'s stage0 `token`) against the
    sessions speaking, counted as the audio seconds the level's sessions received over its seconds (how many
    sessions' voices streamed at once, on average). None where a figure is missing (no token step, no audio)."""
    rows = ((by_kind.get("stage0") or {}).get("token") or {}).get("mean_rows")
    speaking = audio_s / seconds if seconds > 0 and audio_s > 0 else None
    ratio = rows / speaking if rows is not None and speaking else None
    return {"token_rows_per_step": rows, "speaking_sessions": None if speaking is None else round(speaking, 2),
            "share": None if ratio is None else round(ratio, 3), "met": None if ratio is None else ratio >= P12_SHARE}
