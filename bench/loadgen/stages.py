"""Stage metrics from Triton's Prometheus endpoint (model_repository/common/metrics.py writes them).

Scraped before and after a sweep step; the step's mean is Δsum / Δcount of each histogram per stage, so
earlier runs and warm-up do not blur it.
"""

from __future__ import annotations

import re
import urllib.request

STAGES = ("stage0", "tts", "token2wav")
FAMILIES = {"rows_per_step": "duplex_stage_rows_per_step",
            "step_ms": "duplex_stage_step_seconds",
            "queue_wait_ms": "duplex_stage_queue_wait_seconds"}
SCALE = {"rows_per_step": 1.0, "step_ms": 1000.0, "queue_wait_ms": 1000.0}
SCRAPE_TIMEOUT_S = 5.0
_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Sample = dict[tuple[str, str], float]  # (metric name, stage) -> value


def parse(text: str) -> Sample:
    """`*_sum` / `*_count` samples of the duplex stage families, by stage."""
    out: Sample = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or not m["name"].startswith("duplex_stage_") or m["name"].endswith("_bucket"):
            continue
        stage = dict(_LABEL.findall(m["labels"] or "")).get("stage")
        if stage is not None:
            key = (m["name"], stage)
            out[key] = out.get(key, 0.0) + float(m["value"])  # summed over instances (other labels)
    return out


def scrape(url: str) -> Sample:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
        return parse(resp.read().decode())


def means(before: Sample, after: Sample) -> dict[str, dict[str, float | None]]:
    """{"rows_per_step": {stage: mean}, "step_ms": {...}, "queue_wait_ms": {...}} over the interval."""
    out: dict[str, dict[str, float | None]] = {}
    for key, family in FAMILIES.items():
        out[key] = {}
        for stage in STAGES:
            d_sum = after.get((f"{family}_sum", stage), 0.0) - before.get((f"{family}_sum", stage), 0.0)
            d_count = after.get((f"{family}_count", stage), 0.0) - before.get((f"{family}_count", stage), 0.0)
            out[key][stage] = round(d_sum / d_count * SCALE[key], 3) if d_count > 0 else None
    return out
