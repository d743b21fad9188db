"""How late the gateway's event loop runs: one asyncio process serves every session, so a loop that falls behind
delays every session's events at once (the served figure's "rest", bench/RESULTS.md stop 57).

`LoopLagProbe` sleeps `interval_s` over and over and records how much later than asked each sleep returned:
the time the loop spent on other callbacks before it could run this one. Exposed as the histogram
`duplex_event_loop_lag_seconds` (gateway/observability.py); the load generator reads it per level.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

INTERVAL_S = 0.1


class LoopLagProbe:
    def __init__(self, observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
        self._observe, self._interval = observe, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-probe")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self._interval)
            self._observe(max(0.0, loop.time() - t0 - self._interval))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
