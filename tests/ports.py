"""Ports for the servers the tests start.

Asking the kernel for a free port (bind to 0, close, hand the number on) races: under pytest-xdist two workers can
get the same number before either server binds it, and the kernel hands out the same range for outgoing
connections' local ports. One CI run lost a stack that way (its gateway port answered with another worker's
Triton gRPC). Here each xdist worker takes its own block of ports below the kernel's ephemeral range and walks
it, so no two workers, no two calls in one process, and no outgoing connection ever get the same port.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from serve.tritonserver import port_in_use

LOW = 10_000
STRIDE = 4  # a gateway port P and the Triton ports `duplex serve` derives from it, P+1..P+3
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
MIN_SPAN = 4_096  # below this much room under the ephemeral range, share the range above LOW (bind checks only)


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def worker_block(worker: str | None, count: str | None, ephemeral_low: int) -> range:
    """This worker's candidate ports: `worker` is xdist's PYTEST_XDIST_WORKER ("gw3"), None outside xdist."""
    index = int(worker[2:]) if worker and worker.startswith("gw") and worker[2:].isdigit() else 0
    workers = max(int(count) if count and count.isdigit() else 1, index + 1)
    high = ephemeral_low if ephemeral_low - LOW >= MIN_SPAN else LOW + 20_000
    size = (high - LOW) // workers // STRIDE * STRIDE
    start = LOW + index * size
    return range(start, start + size, STRIDE)


def _candidates() -> Iterator[int]:
    block = worker_block(os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
                         _ephemeral_low())
    first = os.getpid() % len(block)  # a rerun soon after starts elsewhere in the block
    return itertools.cycle([*block[first:], *block[:first]])


_lock = threading.Lock()
_next: Iterator[int] | None = None


def free_port() -> int:
    """A port P, with P+1..P+3, free now, not handed to another worker, nor again in this process (until its block
    wraps, thousands of calls on)."""
    global _next  # noqa: PLW0603 - one walk per process
    with _lock:
        if _next is None:
            _next = _candidates()
        for _ in range(100_000):
            port = next(_next)
            if not any(port_in_use(p) for p in range(port, port + STRIDE)):  # the launcher's own check
                return port
    raise RuntimeError("no free block of ports for the tests")
