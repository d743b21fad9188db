"""Warm-up bookkeeping shared by the engines (issue 15: warm before ready, never silently slower).

An engine builds every CUDA graph / compiled step its configuration allows at load, reporting each one
through a `Progress`; once warm, a shape outside the built set is a `GraphMisses` entry: counted per
kind (the stage model publishes the counts as a Triton metric) and logged once per distinct shape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)


class GraphMisses:
    """Per-kind count of calls that found no prebuilt graph after warm-up; the first miss of each
    (kind, shape) is logged at WARNING. Written by the engine thread, read by anyone (a snapshot)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.warm = False  # before warm-up ends, building a graph is the plan, not a miss
        self._counts: Counter[str] = Counter()
        self._seen: set[tuple[str, Hashable]] = set()
        self._lock = threading.Lock()

    def record(self, kind: str, shape: Hashable, fallback: str) -> None:
        """A call of `kind` at `shape` had no prebuilt graph and ran `fallback` ("eager", "captured now")."""
        if not self.warm:
            return
        with self._lock:
            self._counts[kind] += 1
            first = (kind, shape) not in self._seen
            self._seen.add((kind, shape))
        if first:
            log.warning("%s: %s shape %s was not built at warm-up; ran %s (counted in the shape-miss metric)",
                        self.owner, kind, shape, fallback, extra={"kind": kind, "fallback": fallback})

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Progress:
    """Warm-up progress lines: `step(what)` logs `owner warm-up i/n: what (t s)`; `done()` the total."""

    def __init__(self, owner: str, total: int, emit: Callable[[str], None] | None = None) -> None:
        self.owner, self.total, self.done_count = owner, total, 0
        self.emit = emit or log.info
        self.t0 = time.perf_counter()

    def step(self, what: str) -> None:
        self.done_count += 1
        self.emit(f"{self.owner} warm-up {self.done_count}/{self.total}: {what} "
                  f"({time.perf_counter() - self.t0:.1f} s)")

    def done(self) -> float:
        seconds = time.perf_counter() - self.t0
        self.emit(f"{self.owner} warm-up done: {self.done_count} built in {seconds:.1f} s")
        return seconds
