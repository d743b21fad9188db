"""Bench-only: trace the gateway's memory during a soak (`bench/soak.py --tracemalloc-every S`).

The soak puts this directory on `duplex serve`'s PYTHONPATH; every Python process it starts imports this file at
start-up, and only the gateway (`-m gateway.serving`) acts on it. Nothing in the product reads these variables.

    BENCH_TRACEMALLOC_DIR     where to write (unset: do nothing)
    BENCH_TRACEMALLOC_EVERY   seconds between snapshots (allocation sites); memory figures every tenth of that
    BENCH_TRACEMALLOC_FRAMES  frames kept per allocation (default 1: site = the allocating line; 0: no tracemalloc,
                              the readings alone)
    BENCH_GC_COLLECT_EVERY    seconds between forced full collections (a hypothesis test; unset: none)
    BENCH_MALLOC_TRIM_EVERY   seconds between glibc malloc_trim(0) calls (a hypothesis test; unset: none)
    BENCH_GC_GARBAGE_EVERY    seconds between full collections that tally what they free (objects in reference
                              cycles, by type: count and shallow bytes) before freeing it (unset: none)

Writes `stats.jsonl` (one line per reading: RSS, traced bytes, glibc's mallinfo2, gc counters; one line per full
collection) and `sites-NNNNN.json` (every allocation site: file:line, bytes, blocks) for bench/tracemalloc_report.py.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkd", "usmblks", "fsmblks", "uordblks", "fordblks",
                    "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


def _status_kb() -> dict[str, int]:
    """VmRSS and its parts: anonymous (the heap), file-backed (code and data of the libraries: the kernel may
    drop these pages under memory pressure and fault them back later), shared memory."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.partition(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(line.split()[1])
    return out


def _size(obj: object) -> int:
    """Shallow bytes, with the data of an array that owns it."""
    own = getattr(obj, "base", 1) is None and isinstance(getattr(obj, "nbytes", None), int)
    return sys.getsizeof(obj, 0) + (obj.nbytes if own else 0)  # type: ignore[attr-defined]


def _rss_kb() -> int:
    return _status_kb().get("VmRSS", 0)


class Tracer:
    def __init__(self, out: Path, every_s: float) -> None:
        self.out, self.every_s, self.t0 = out, every_s, time.monotonic()
        self.libc = _libc()
        self.stats = open(out / "stats.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the process's life
        self.lock = threading.Lock()
        self.gc_started = 0.0

    def line(self, row: dict) -> None:
        with self.lock:
            self.stats.write(json.dumps(row) + "\n")

    def reading(self, kind: str = "reading") -> dict:
        traced, peak = tracemalloc.get_traced_memory()
        status = _status_kb()
        row = {"kind": kind, "t_s": round(time.monotonic() - self.t0, 1), "rss_kb": status.get("VmRSS", 0),
               "rss_anon_kb": status.get("RssAnon", 0), "rss_file_kb": status.get("RssFile", 0),
               "traced_kb": traced // 1024, "traced_peak_kb": peak // 1024,
               "tracemalloc_overhead_kb": tracemalloc.get_tracemalloc_memory() // 1024,
               "gc_collections": [g["collections"] for g in gc.get_stats()], "gc_count": list(gc.get_count())}
        if self.libc is not None:
            info = self.libc.mallinfo2()
            row["mallinfo2_kb"] = {name: getattr(info, name) // 1024 for name in MALLINFO2_FIELDS}
        return row

    def sites(self, n: int) -> None:
        row = self.reading("sites")  # first: the snapshot itself costs tens of MB for a moment
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        row["sites"] = [[f"{s.traceback[0].filename}:{s.traceback[0].lineno}", s.size, s.count]
                        for s in snap.statistics("lineno")]
        del snap
        (self.out / f"sites-{n:05d}.json").write_text(json.dumps(row))
        self.line({k: v for k, v in row.items() if k != "sites"})

    def on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self.gc_started = time.monotonic()
            self.rss_before = _rss_kb()
            self.traced_before = tracemalloc.get_traced_memory()[0] // 1024
            return
        self.line({"kind": "gc2", "t_s": round(time.monotonic() - self.t0, 1),
                   "ms": round((time.monotonic() - self.gc_started) * 1000, 1), "collected": info["collected"],
                   "rss_kb_before": self.rss_before, "rss_kb_after": _rss_kb(),
                   "traced_kb_before": self.traced_before,
                   "traced_kb_after": tracemalloc.get_traced_memory()[0] // 1024})

    def garbage(self) -> None:
        """A full collection that keeps what it finds (DEBUG_SAVEALL), tallies it by type, then frees it."""
        before = _rss_kb()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = list(gc.garbage)
            gc.garbage.clear()
        finally:
            gc.set_debug(0)
        tally: dict[str, list[int]] = {}
        seen: set[int] = set()
        for obj in found:  # noqa: B007 - the last one is dropped with the list below
            kind = type(obj)
            row = tally.setdefault(f"{kind.__module__}.{kind.__qualname__}", [0, 0, 0])
            row[0] += 1
            row[1] += _size(obj)
            # what only the garbage holds and the collector does not track: bytes, str, arrays (the payload)
            for ref in gc.get_referents(obj):
                if not gc.is_tracked(ref) and id(ref) not in seen:
                    seen.add(id(ref))
                    row[2] += _size(ref)
        del found
        held = _rss_kb()
        gc.collect()
        top = sorted(tally.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:25]
        self.line({"kind": "garbage", "t_s": round(time.monotonic() - self.t0, 1),
                   "objects": sum(v[0] for v in tally.values()), "shallow_kb": sum(v[1] for v in tally.values()) // 1024,
                   "payload_kb": sum(v[2] for v in tally.values()) // 1024,
                   "rss_kb_before": before, "rss_kb_held": held, "rss_kb_after": _rss_kb(),
                   "types": [[name, n, size // 1024, payload // 1024] for name, (n, size, payload) in top]})

    def run(self) -> None:
        tick, n = self.every_s / 10, 0
        gc_every = float(os.environ.get("BENCH_GC_COLLECT_EVERY") or 0)
        trim_every = float(os.environ.get("BENCH_MALLOC_TRIM_EVERY") or 0)
        garbage_every = float(os.environ.get("BENCH_GC_GARBAGE_EVERY") or 0)
        last_gc = last_trim = last_garbage = time.monotonic()
        while True:
            time.sleep(tick)
            now = time.monotonic()
            if gc_every and now - last_gc >= gc_every:
                gc.collect()
                last_gc = now
            if garbage_every and now - last_garbage >= garbage_every:
                self.garbage()
                last_garbage = now
            if trim_every and self.libc is not None and now - last_trim >= trim_every:
                before = _rss_kb()
                self.libc.malloc_trim(0)
                self.line({"kind": "trim", "t_s": round(now - self.t0, 1), "rss_kb_before": before,
                           "rss_kb_after": _rss_kb()})
                last_trim = now
            if n % 10 == 0 and tracemalloc.is_tracing():
                self.sites(n // 10)
            else:
                self.line(self.reading())
            n += 1


def _start() -> None:
    out = os.environ.get("BENCH_TRACEMALLOC_DIR")
    if not out or "gateway.serving" not in getattr(sys, "orig_argv", ()):
        return
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get("BENCH_TRACEMALLOC_FRAMES") or 1)
    if frames:  # 0: the memory readings alone, without tracemalloc's own cost
        tracemalloc.start(frames)
    tracer = Tracer(path, float(os.environ.get("BENCH_TRACEMALLOC_EVERY") or 60))
    gc.callbacks.append(tracer.on_gc)
    threading.Thread(target=tracer.run, name="bench-tracemalloc", daemon=True).start()


_start()
