"""The sweep: end the Triton sequences of sessions whose gateway died and that nobody adopted, so their replica
slots come free.

Every gateway sweeps every `interval_s`; `SessionDirectory.claim_orphans` hands each dead owner's record to
exactly one of them, once it has been orphaned for `grace_s` (the resume grace, `disconnect_grace_s`: until then
a resume may adopt the session, adopt.py). The sequence is closed on its replica through a stream of its own, with the session's
incarnation and an epoch past any the dead owner could have reached, which the stages' fence rule accepts as
the newest fence (model_repository/common/sessions.py). Without the sweep the replica would hold the slot
until its idle timeout (the profile's `session_idle_ttl_s`, minutes).

NOTE: a gateway cut off from Redis for longer than its lease counts as dead: its sessions are swept while it
may still serve them; once it reaches Redis again it finds their records gone and ends them (runtime_dead,
gateway/directory/runtime.py). The lease (10 s, refreshed every 3.3 s) is the trade-off between that and how long
a dead gateway's slots stay taken.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.directory.store import Entry, SessionDirectory
from gateway.runtime.base import Fence, RuntimeFailure, SessionKey
from gateway.runtime.stages import StagedTritonRuntime

ORPHAN_EPOCH = 2**62  # past any epoch a session reaches (one per cancel)

log = logging.getLogger(__name__)


async def close_orphan(entry: Entry, *, batch_dim: bool = True) -> None:
    runtime = StagedTritonRuntime(entry.replica, batch_dim=batch_dim)
    key = SessionKey(entry.session_id, entry.correlation_id)
    try:
        runtime.adopt(key)
        await runtime.close(key, Fence(entry.incarnation, ORPHAN_EPOCH))
    finally:
        await runtime.aclose()


class Sweeper:
    def __init__(self, directory: SessionDirectory, interval_s: float, timeout_s: float, *,
                 batch_dim: bool = True, grace_s: float = 0.0) -> None:
        self.directory, self.interval_s, self.timeout_s, self.batch_dim = directory, interval_s, timeout_s, batch_dim
        self.grace_s = grace_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: the next round tries again
                log.warning("directory sweep failed: %s", exc)

    async def sweep(self) -> int:
        """One round; returns how many orphaned sessions were closed."""
        closed = 0
        for entry in await self.directory.claim_orphans(self.grace_s):
            try:
                async with asyncio.timeout(self.timeout_s):
                    await close_orphan(entry, batch_dim=self.batch_dim)
                closed += 1
                log.info("closed session %s of dead gateway %s on %s", entry.session_id, entry.owner, entry.replica)
            except (RuntimeFailure, TimeoutError, OSError) as exc:  # the replica died too: nothing is held there
                log.warning("could not close orphaned session %s on %s: %s", entry.session_id, entry.replica, exc)
        return closed
