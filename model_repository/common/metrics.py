"""Stage metrics on Triton's Prometheus endpoint: rows per engine step, step time, queue wait (issue 13).

Three histograms, labelled by `stage` (stage0 | tts | token2wav), through the Python backend's custom
metrics API (`pb_utils.MetricFamily`, histograms present in Triton 2.51):
  duplex_stage_rows_per_step        rows one engine step served (batch occupancy; a row is one session's
                                    unit, token or chunk in that step)
  duplex_stage_step_seconds         wall time of one engine step that had work
  duplex_stage_queue_wait_seconds   a request's wait from `submit` (adapter thread) until the engine
                                    thread took it (it waits while a step runs)
`_sum / _count` of a histogram is its mean; the load generator diffs them around a run.
A step slower than SLOW_STEP_S is also logged (WARNING, at most one line per SLOW_LOG_EVERY_S, with the count
since the last line): a stall that a mean hides shows in the log with its rows.
Two more, labelled by `stage` and `kind`, where the bridge tells what a step ran (stage0: `prefill`, a unit,
close or prefix row, so the audio front end and a prefill pass, maybe beside decoded tokens; `decode`, decoded
tokens only): a prefill's cost served apart from the decode steps
  duplex_stage_kind_rows_per_step   rows of the steps of that kind
  duplex_stage_kind_step_seconds    wall time of the steps of that kind
and, under `kind="token"`, every step that decoded a token (a decode step, or a prefill step with decoded tokens
beside its prefill rows: the shared pass) with its token rows only: P12's rows per decode step, wherever the tokens
ran (the decode steps alone miss the tokens that rode along a prefill).
One counter, labelled by `stage` and `kind` (issue 15):
  duplex_stage_graph_misses_total   engine calls whose shape had no CUDA graph / compiled step built at
                                    warm-up (engine/warmup.py GraphMisses; each shape is also logged once)

Every `observe` is an IPC round trip to the Triton process (measured: 70 us on a loaded 2-core CPU host,
Triton 2.51; a busy Python thread kept ~77 % of its speed while a flush ran), so the engine thread never
makes one: it appends to a buffer, and a flusher thread hands the buffer to Triton every `FLUSH_S`. The
cost grows with the observations (2 per step, 4 with a kind, 6 with tokens too, + 1 per request), not with the flush rate.
Outside Triton (`pb_utils` absent: unit tests of the bridges) the same object keeps only the in-memory totals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

FLUSH_S = 0.5
SLOW_STEP_S = 0.25
SLOW_LOG_EVERY_S = 10.0
ROW_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
FAMILIES = {  # key -> (name, description, buckets)
    "rows": ("duplex_stage_rows_per_step", "Rows one engine step served (batch occupancy)", ROW_BUCKETS),
    "step": ("duplex_stage_step_seconds", "Wall time of one engine step that had work", SECONDS_BUCKETS),
    "wait": ("duplex_stage_queue_wait_seconds", "Request submit -> taken by the engine thread", SECONDS_BUCKETS),
}
KIND_FAMILIES = {  # the same by the step's kind (`StageMetrics.step(kind=...)`)
    "rows": ("duplex_stage_kind_rows_per_step", "Rows one engine step served, by what it ran", ROW_BUCKETS),
    "step": ("duplex_stage_kind_step_seconds", "Wall time of one engine step that had work, by what it ran",
             SECONDS_BUCKETS),
}
TOKEN_KIND = "token"  # the steps that decoded tokens, counting their token rows (P12)
MISSES = ("duplex_stage_graph_misses_total", "Engine calls whose shape had no graph built at warm-up")


@dataclass
class Totals:
    """In-memory running totals per family (count, sum), kept with or without Triton."""
    count: int = 0
    total: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class _TritonHistograms:
    """key -> pb_utils histogram labelled with the stage. NOTE: a Metric fails once its MetricFamily is
    collected, so the families stay referenced here for the life of the stage."""

    def __init__(self, pb_utils: Any, stage: str) -> None:
        self.families, self.metrics = {}, {}
        for key, (name, description, buckets) in FAMILIES.items():
            self.families[key] = pb_utils.MetricFamily(name=name, description=description,
                                                       kind=pb_utils.MetricFamily.HISTOGRAM)
            self.metrics[key] = self.families[key].Metric(labels={"stage": stage}, buckets=buckets)
        self.stage = stage
        self.kind_families = {key: pb_utils.MetricFamily(name=name, description=description,
                                                         kind=pb_utils.MetricFamily.HISTOGRAM)
                              for key, (name, description, _) in KIND_FAMILIES.items()}
        self.kind_metrics: dict[tuple[str, str], Any] = {}
        self.misses = pb_utils.MetricFamily(name=MISSES[0], description=MISSES[1], kind=pb_utils.MetricFamily.COUNTER)
        self.miss_counters: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self.metrics[key]

    def release(self) -> None:
        """Drop every Metric before its MetricFamily (a Metric needs its family)."""
        self.metrics.clear()
        self.kind_metrics.clear()
        self.miss_counters.clear()
        self.families.clear()
        self.kind_families.clear()
        self.misses = None

    def by_kind(self, key: str, kind: str) -> Any:
        """The histogram of family `key` (KIND_FAMILIES) for steps of `kind`, made at its first use."""
        if (key, kind) not in self.kind_metrics:
            self.kind_metrics[key, kind] = self.kind_families[key].Metric(
                labels={"stage": self.stage, "kind": kind}, buckets=KIND_FAMILIES[key][2])
        return self.kind_metrics[key, kind]

    def miss_counter(self, kind: str) -> Any:
        if kind not in self.miss_counters:
            self.miss_counters[kind] = self.misses.Metric(labels={"stage": self.stage, "kind": kind})
        return self.miss_counters[kind]


def _triton_histograms(stage: str) -> _TritonHistograms | None:
    """None outside a Triton stub (no `triton_python_backend_utils`)."""
    try:
        import triton_python_backend_utils as pb_utils
    except ImportError:
        return None
    return _TritonHistograms(pb_utils, stage)


class StageMetrics:
    def __init__(self, stage: str, histograms: Callable[[str], Any] = _triton_histograms,
                 flush_s: float = FLUSH_S) -> None:
        self.stage = stage
        self.totals = {key: Totals() for key in FAMILIES}
        self.kind_totals: dict[tuple[str, str], Totals] = {}  # (family key, step kind) -> totals
        self._sink = histograms(stage)
        self._pending: list[tuple[str, str | None, float]] = []  # (family key, step kind or None, value)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flush_s = flush_s
        self._thread = threading.Thread(target=self._run, name=f"{stage}-metrics", daemon=True) \
            if self._sink is not None else None
        self._misses: Callable[[], dict[str, int]] = dict
        self._misses_sent: dict[str, int] = {}
        self.slow_steps = 0
        self._slow_unlogged, self._slow_logged_at = 0, float("-inf")

    def watch_misses(self, source: Callable[[], dict[str, int]]) -> None:
        """`source()` -> the engine's graph-miss counts per kind (running totals); flushed as counters."""
        self._misses = source

    def misses(self) -> dict[str, int]:
        return dict(self._misses())

    # ---- engine thread ------------------------------------------------------------------------------
    def step(self, rows: int, seconds: float, kind: str | None = None, token_rows: int = 0) -> None:
        self._add("rows", float(rows))
        self._add("step", seconds)
        if kind is not None:
            self._add("rows", float(rows), kind)
            self._add("step", seconds, kind)
        if token_rows:
            self._add("rows", float(token_rows), TOKEN_KIND)
            self._add("step", seconds, TOKEN_KIND)
        if seconds > SLOW_STEP_S:
            self._slow(rows, seconds)

    def _slow(self, rows: int, seconds: float) -> None:
        self.slow_steps += 1
        self._slow_unlogged += 1
        now = time.monotonic()
        if now - self._slow_logged_at >= SLOW_LOG_EVERY_S:
            log.warning("%s: a step took %.0f ms for %d rows (%d steps over %.0f ms since the last such line)",
                        self.stage, seconds * 1000.0, rows, self._slow_unlogged, SLOW_STEP_S * 1000.0)
            self._slow_logged_at, self._slow_unlogged = now, 0

    def queue_wait(self, seconds: float) -> None:
        self._add("wait", seconds)

    def _add(self, key: str, value: float, kind: str | None = None) -> None:
        with self._lock:
            totals = self.totals[key] if kind is None else self.kind_totals.setdefault((key, kind), Totals())
            totals.count += 1
            totals.total += value
            if self._sink is not None:
                self._pending.append((key, kind, value))

    # ---- flusher thread -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        self.flush()
        # NOTE: release the Triton metric objects now, in finalize, while the stub can still unregister them;
        # left to the interpreter's exit-time garbage collection they segfaulted every stage stub at unload.
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.release()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if self._sink is None:
            return
        for key, kind, value in pending:
            (self._sink[key] if kind is None else self._sink.by_kind(key, kind)).observe(value)
        for kind, total in self.misses().items():
            delta = total - self._misses_sent.get(kind, 0)
            if delta > 0:
                self._sink.miss_counter(kind).increment(delta)
                self._misses_sent[kind] = total

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            self.flush()
