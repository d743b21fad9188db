"""gateway/looplag.py: the probe records how late the event loop ran its timer, so a callback that holds the loop
shows up as lag, and an idle loop as next to none."""

from __future__ import annotations

import asyncio
import time

from gateway.looplag import LoopLagProbe


async def test_a_blocked_loop_shows_as_lag_and_an_idle_one_does_not() -> None:
    seen: list[float] = []
    probe = LoopLagProbe(seen.append, interval_s=0.02)
    probe.start()
    await asyncio.sleep(0.15)  # idle: a few probes
    idle = list(seen)
    time.sleep(0.2)  # noqa: ASYNC251 - the point: a callback that holds the loop for 200 ms
    await asyncio.sleep(0.05)
    await probe.aclose()
    assert len(idle) >= 2 and max(idle) < 0.1  # next to none; the margin is for a CI machine's busy cores
    assert max(seen[len(idle):]) >= 0.15  # the probe due during the block ran that much late
    n = len(seen)
    await asyncio.sleep(0.05)
    assert len(seen) == n  # closed: no more probes
