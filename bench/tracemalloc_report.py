"""Which allocations make the gateway's RSS swing: read what bench/tracemalloc_site/sitecustomize.py wrote during
a soak (`bench/soak.py --tracemalloc-every S`) and compare allocation sites at RSS peaks and troughs.

Prints the gateway's memory over time (RSS; bytes tracemalloc traces, i.e. Python's allocations; glibc's malloc
in use and free-but-held, from mallinfo2), every full (generation 2) garbage collection with the RSS and traced
bytes it freed, and for each climb (trough -> peak) and fall (peak -> trough) of RSS larger than `--min-swing-mb`
the allocation sites (file:line) whose bytes changed most.

    python bench/tracemalloc_report.py .cache/soak/tracemalloc --out bench/results/soak-tracemalloc.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

MB = 1024  # readings are in KB


def load(folder: Path) -> tuple[list[dict], list[dict], list[dict]]:
    rows = [json.loads(line) for line in (folder / "stats.jsonl").read_text().splitlines() if line.strip()]
    readings = [r for r in rows if r["kind"] in ("reading", "sites")]
    events = [r for r in rows if r["kind"] in ("gc2", "trim", "garbage")]
    snaps = sorted((json.loads(p.read_text()) for p in folder.glob("sites-*.json")), key=lambda s: s["t_s"])
    return readings, events, snaps


def short(site: str) -> str:
    """Drop the interpreter's and the venv's prefixes from a file name."""
    return re.sub(r"^.*?/(site-packages|lib/python3\.\d+|work/main)/", "", site)


def zigzag(values: list[float], swing: float) -> list[int]:
    """Indexes of alternating extremes (trough, peak, ... or peak, trough, ...) that differ by at least `swing`."""
    turns: list[int] = []
    lo = hi = 0
    rising: bool | None = None
    for i, v in enumerate(values):
        if rising is None:
            lo = i if v < values[lo] else lo
            hi = i if v > values[hi] else hi
            if values[hi] - values[lo] >= swing:
                rising = hi > lo
                turns.append(lo if rising else hi)
                lo = hi = i
        elif rising:
            if v > values[hi]:
                hi = i
            elif values[hi] - v >= swing:
                turns.append(hi)
                rising, lo = False, i
        else:
            if v < values[lo]:
                lo = i
            elif v - values[lo] >= swing:
                turns.append(lo)
                rising, hi = True, i
    if rising is not None:
        turns.append(hi if rising else lo)
    return turns


def site_delta(a: dict, b: dict, top: int) -> list[dict[str, Any]]:
    before = {site: (size, count) for site, size, count in a["sites"]}
    after = {site: (size, count) for site, size, count in b["sites"]}
    diff = []
    for site in before.keys() | after.keys():
        s0, c0 = before.get(site, (0, 0))
        s1, c1 = after.get(site, (0, 0))
        diff.append({"site": short(site), "kb": round((s1 - s0) / 1024, 1), "blocks": c1 - c0,
                     "kb_after": round(s1 / 1024, 1)})
    diff.sort(key=lambda d: -abs(d["kb"]))
    return diff[:top]


def mem(r: dict) -> dict[str, float]:
    info = r.get("mallinfo2_kb", {})
    return {"rss_mb": round(r["rss_kb"] / MB, 1), "rss_anon_mb": round(r.get("rss_anon_kb", 0) / MB, 1),
            "rss_file_mb": round(r.get("rss_file_kb", 0) / MB, 1), "traced_mb": round(r["traced_kb"] / MB, 1),
            "tracemalloc_overhead_mb": round(r["tracemalloc_overhead_kb"] / MB, 1),
            "malloc_in_use_mb": round((info.get("uordblks", 0) + info.get("hblkd", 0)) / MB, 1),
            "malloc_free_held_mb": round(info.get("fordblks", 0) / MB, 1),
            "gc2_runs": r["gc_collections"][2]}


def nearest(snaps: list[dict], t: float) -> dict:
    return min(snaps, key=lambda s: abs(s["t_s"] - t))


def swings(readings: list[dict], snaps: list[dict], swing_kb: float, top: int) -> list[dict[str, Any]]:
    """RSS climbs and falls from the plain readings (a snapshot's own cost stays out), each with the allocation
    sites that changed between the snapshots nearest to its ends."""
    turns = zigzag([r["rss_kb"] for r in readings], swing_kb)
    out = []
    for i, j in zip(turns, turns[1:], strict=False):
        a, b = readings[i], readings[j]
        ma, mb = mem(a), mem(b)
        row = {"from_t_s": a["t_s"], "to_t_s": b["t_s"], "kind": "climb" if b["rss_kb"] > a["rss_kb"] else "fall",
               "delta_mb": {k: round(mb[k] - ma[k], 1) for k in ma}, "at_end": mb}
        if snaps:
            sa, sb = nearest(snaps, a["t_s"]), nearest(snaps, b["t_s"])
            row |= {"sites_from_t_s": sa["t_s"], "sites_to_t_s": sb["t_s"], "sites": site_delta(sa, sb, top)}
        out.append(row)
    return out


def correlation(readings: list[dict]) -> dict[str, float]:
    """How each part of the gateway's memory follows RSS over the run (Pearson r) and how far it moves."""
    rows = [mem(r) for r in readings]
    rss = np.array([r["rss_mb"] for r in rows])
    out: dict[str, float] = {"rss_range_mb": round(float(np.ptp(rss)), 1)}
    for key in ("rss_anon_mb", "rss_file_mb", "traced_mb", "malloc_in_use_mb", "malloc_free_held_mb"):
        x = np.array([r[key] for r in rows])
        out[f"{key}_range"] = round(float(np.ptp(x)), 1)
        out[f"{key}_r_with_rss"] = round(float(np.corrcoef(rss, x)[0, 1]), 2) if np.std(x) and np.std(rss) else 0.0
    return out


def trims(events: list[dict]) -> dict[str, float] | None:
    freed = [(e["rss_kb_before"] - e["rss_kb_after"]) / MB for e in events if e["kind"] == "trim"]
    if not freed:
        return None
    return {"trims": len(freed), "freed_mb_median": round(float(np.median(freed)), 1),
            "freed_mb_max": round(max(freed), 1), "freed_mb_total": round(sum(freed), 1)}


def report(folder: Path, swing_mb: float, top: int, warm_s: float) -> dict[str, Any]:
    readings, events, snaps = load(folder)
    plain = [r for r in readings if r["kind"] == "reading"]
    warm = [r for r in plain if r["t_s"] >= warm_s] or plain
    return {"timeline": [{"t_s": r["t_s"]} | mem(r) for r in plain], "events": events,
            "correlation_after_warmup": correlation(warm), "trims": trims(events),
            "swings": swings(warm, [s for s in snaps if s["t_s"] >= warm_s] or snaps, swing_mb * MB, top)}


def show(rep: dict[str, Any], every: int) -> str:
    cols = ("t_s", "rss_mb", "rss_anon_mb", "rss_file_mb", "traced_mb", "tracemalloc_overhead_mb", "malloc_in_use_mb", "malloc_free_held_mb",
            "gc2_runs")
    lines = [" | ".join(cols)] + [" | ".join(str(r[c]) for c in cols) for r in rep["timeline"][::every]]
    lines.append("\nfull collections (t_s, ms, objects collected, RSS MB before -> after, traced MB before -> after)")
    for e in rep["events"]:
        if e["kind"] == "gc2":
            lines.append(f"  {e['t_s']} {e['ms']} {e['collected']} {e['rss_kb_before'] / MB:.1f} -> "
                         f"{e['rss_kb_after'] / MB:.1f}  {e['traced_kb_before'] / MB:.1f} -> "
                         f"{e['traced_kb_after'] / MB:.1f}")
        elif e["kind"] == "garbage":
            lines.append(f"  garbage at {e['t_s']}: {e['objects']} objects in cycles, {e['shallow_kb'] / MB:.1f} MB "
                         f"+ {e['payload_kb'] / MB:.1f} MB they alone hold; RSS {e['rss_kb_before'] / MB:.1f} -> "
                         f"{e['rss_kb_after'] / MB:.1f}")
            lines += [f"      {n:7d} {size:8d} KB + {payload:8d} KB  {name}" for name, n, size, payload in e["types"][:10]]
        elif e["kind"] == "trim":
            lines.append(f"  malloc_trim at {e['t_s']}: RSS {e['rss_kb_before'] / MB:.1f} -> {e['rss_kb_after'] / MB:.1f}")
    lines.append(f"\nafter warm-up: {rep['correlation_after_warmup']}\ntrims: {rep['trims']}")
    for s in rep["swings"]:
        lines.append(f"\n{s['kind']} {s['from_t_s']} -> {s['to_t_s']} s: {s['delta_mb']}"
                     f"  (sites {s.get('sites_from_t_s')} -> {s.get('sites_to_t_s')} s)")
        lines += [f"  {d['kb']:+10.1f} KB {d['blocks']:+8d} blocks  {d['site']}  (now {d['kb_after']} KB)"
                  for d in s.get("sites", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="BENCH_TRACEMALLOC_DIR of the run (the soak's CACHE_DIR/tracemalloc)")
    ap.add_argument("--min-swing-mb", type=float, default=25.0, help="an RSS climb or fall at least this large")
    ap.add_argument("--top", type=int, default=12, help="allocation sites per swing")
    ap.add_argument("--every", type=int, default=6, help="print every Nth reading")
    ap.add_argument("--warm-s", type=float, default=120.0, help="leave out the gateway's first seconds (start-up)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rep = report(args.folder, args.min_swing_mb, args.top, args.warm_s)
    print(show(rep, args.every))
    if args.out is not None:
        args.out.write_text(json.dumps(rep, indent=None, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
