"""One engine step at a time on a device, the upstream stage first (deploy profile `gpu_gate`).

Under MPS the three stage processes' kernels overlap on the GPU: a chain of small kernels runs 15-24x slower
beside large GEMMs (bench/RESULTS.md, stop 32 item 5), and served at 16 sessions every stage step took 2.5-3x
its time alone (stage0 16.8 vs 6.2 ms, TTS 63-81 vs 31, Token2Wav 56 vs 22; stop 39). With the gate a stage holds
its device for one engine step, from launch to completion, while the others wait; each step then runs at about
its own speed, and a turn's first unit passes stage0, the TTS and Token2Wav without sharing the GPU with each
step of the others. Whether that beats the overlap is for the H200 to say (bench/h200/README.md).

Priorities: a lower number goes first. A stage that got the lock while a stage of a higher priority waits gives it
back and retries after `YIELD_S`, for at most `MAX_DEFER_S` from its first deferral (no stage starves). Stages of
the same priority (instances of one stage) take turns as the lock falls to them.

Across processes through flock(2), one set of files per device in the temp dir: `<device>.lock`, held
exclusively by the stage whose step runs, and `<device>.intent<p>`, held shared by every stage of priority p
while it waits; a lower stage probes it with a non-blocking exclusive lock. The kernel drops a dead process's
locks, so a crashed stage never leaves the gate closed.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

PRIORITIES = 8  # priorities 0..7; a profile needs three at most (stage0, tts, token2wav)
YIELD_S = 0.0002  # a stage that gave the lock back to a waiting higher one sleeps this long before retrying
MAX_DEFER_S = 0.05  # after deferring this long a stage takes the lock whoever waits
GATE_DIR = Path(tempfile.gettempdir()) / "duplex-gpu-gate"


class GpuGate:
    """`with gate.hold(): ...` runs the block while no other gated stage on the same device runs its own."""

    def __init__(self, device: str, priority: int, directory: Path = GATE_DIR) -> None:
        if not 0 <= priority < PRIORITIES:
            raise ValueError(f"gpu gate priority {priority} must be in 0..{PRIORITIES - 1}")
        self.device, self.priority = device, priority
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / re.sub(r"[^A-Za-z0-9_.-]", "_", device)
        self._lock = _open(stem.with_suffix(".lock"))
        self._intents = [_open(Path(f"{stem}.intent{p}")) for p in range(priority + 1)]
        self.deferrals = 0  # times this stage gave the lock back to a higher one

    @contextmanager
    def hold(self) -> Iterator[None]:
        mine = self._intents[self.priority]
        fcntl.flock(mine, fcntl.LOCK_SH)  # waiting: lower stages that get the lock now give it back
        try:
            deferring_since: float | None = None  # the first time it gave the lock back (not the wait before)
            while True:
                fcntl.flock(self._lock, fcntl.LOCK_EX)
                if not self._higher_waiting():
                    break
                now = time.monotonic()
                deferring_since = now if deferring_since is None else deferring_since
                if now - deferring_since >= MAX_DEFER_S:
                    break
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                self.deferrals += 1
                time.sleep(YIELD_S)
        finally:
            fcntl.flock(mine, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def _higher_waiting(self) -> bool:
        for intent in self._intents[:self.priority]:
            try:
                fcntl.flock(intent, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(intent, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        for f in (self._lock, *self._intents):
            f.close()


def _open(path: Path) -> IO[bytes]:
    # NOTE: flock locks belong to the open file description: each gate opens its own, so two gates in one process
    # (the tests) contend like two processes
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    return os.fdopen(fd, "r+b", buffering=0)
