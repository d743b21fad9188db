"""`DirectoryRuntime`: any `Runtime`, with each session's open and close written to the shared directory.

The runtime open is where a session gets its replica, so the record is written right after it succeeds (a
failed open leaves nothing behind) and deleted when the runtime close ends, whatever its outcome. While the
session is hosted, its `Replicator` (replica.py) keeps its journal and state in Redis (`replicate`); a session
adopted from a dead gateway is bound to its replica again with `reattach` (adopt.py). Readiness includes the
directory: a gateway that cannot reach Redis could not record new sessions, so it is not ready. The first
readiness probe (a gateway serves nothing before one: the handshake asks too) takes the lease and starts the
sweep (sweep.py). Every session operation is the inner runtime's.

Self-fencing: a gateway cut off from Redis past its lease counts as dead, and its sessions may be adopted by
another gateway or swept while it still serves them. It learns so from Redis, by a write-through that is refused
(replica.py) or by the ownership check of all its sessions once per lease refresh period (`_watch`, which also
renews their copies' TTL), and then ends each such session here: its client is told (`OwnerLost`, handled by the
session's actor: `session.replaced` when another gateway adopted it, `runtime_dead` when it was swept), and its
close sends nothing to the Triton sequence and deletes no record, both of which are another gateway's (or nobody's)
now: only this gateway's own stream is dropped (`forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.directory.replica import ReplicatedHost, Replicator
from gateway.directory.store import REFRESHES_PER_LEASE, Ownership, SessionDirectory
from gateway.directory.sweep import Sweeper
from gateway.runtime.base import (
    Fence,
    Readiness,
    Runtime,
    RuntimeEvent,
    RuntimeFailure,
    SessionKey,
    UnitSubmission,
)
from gateway.ws.messages import OwnerLost

log = logging.getLogger(__name__)


class DirectoryRuntime:
    def __init__(self, inner: Runtime, directory: SessionDirectory, default_replica: str,
                 sweeper: Sweeper | None = None) -> None:
        self.inner, self.directory, self._default_replica = inner, directory, default_replica
        self._sweeper = sweeper
        self._sweeping: asyncio.Task[None] | None = None
        self._replicators: dict[str, Replicator] = {}
        self._lost: set[str] = set()  # sessions whose record is not this gateway's any more (self-fenced)
        self._watching: asyncio.Task[None] | None = None

    def _replica(self, key: SessionKey) -> str:
        replica_of = getattr(self.inner, "replica_of", None)  # ReplicaRuntime knows; one Triton is the default
        return replica_of(key).endpoint.grpc if replica_of is not None else self._default_replica

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        await self.inner.open(key, fence, config)
        try:
            await self.directory.register(key.session_id, self._replica(key), key.correlation_id, fence.incarnation)
        except Exception as exc:  # a session no other gateway can find must not start: undo the open
            await self.inner.close(key, fence)
            raise RuntimeFailure("internal_error", f"session directory: {exc}") from exc

    def replicate(self, host: ReplicatedHost) -> None:
        """A session this gateway now hosts (opened here, or adopted): keep its copy in Redis until its close."""
        assert host.session is not None
        sid = host.session.session_id
        replicator = Replicator(self.directory, sid, host, on_lost=self._lose)
        self._replicators[sid] = replicator
        replicator.start()
        if self._watching is None:
            self._watching = asyncio.create_task(self._watch(), name="directory-ownership")

    def _lose(self, session_id: str, ownership: Ownership) -> None:
        """Self-fence one session: its record was taken over (MOVED) or is gone (GONE)."""
        replicator = self._replicators.get(session_id)
        if replicator is None or session_id in self._lost:
            return  # closed meanwhile (its record went with the close), or told already
        self._lost.add(session_id)
        replicator.stop_lost()
        log.warning("directory: session %s is %s; ending it here without touching its sequence", session_id,
                    "another gateway's now" if ownership is Ownership.MOVED else "gone from the directory")
        replicator.host.post(OwnerLost(moved=ownership is Ownership.MOVED))

    async def _watch(self) -> None:
        """Once per lease refresh period: is every session hosted here still this gateway's (and its copy kept)?"""
        while True:
            await asyncio.sleep(self.directory.lease_s / REFRESHES_PER_LEASE)
            try:
                found = await self.directory.check_owned([s for s in self._replicators if s not in self._lost])
            except Exception as exc:  # noqa: BLE001 - Redis away: the next round asks again
                log.warning("directory: ownership check failed: %s", exc)
                continue
            for sid, ownership in found.items():
                if ownership is not Ownership.MINE:
                    self._lose(sid, ownership)

    async def reattach(self, key: SessionKey, replica: str) -> None:
        """A dead gateway's session, adopted here (adopt.py): its operations go to `replica` from now on."""
        reattach = getattr(self.inner, "reattach", None)
        if reattach is not None:
            reattach(key, replica)
            return
        adopt = getattr(self.inner, "adopt", None)  # one Triton: the session must be on it
        if adopt is None or replica != self._default_replica:
            raise RuntimeFailure("session_not_found", f"replica {replica} is not this gateway's")
        adopt(key)

    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        await self.inner.append(key, fence, unit)

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        await self.inner.cancel(key, fence, next_fence)

    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        await self.inner.update(key, fence, config)

    async def close(self, key: SessionKey, fence: Fence) -> None:
        replicator = self._replicators.pop(key.session_id, None)
        if replicator is not None:  # first: a write landing after the record's delete would bring part of it back
            await replicator.aclose()
        if key.session_id in self._lost:  # self-fenced: the sequence and the record are not this gateway's
            self._lost.discard(key.session_id)
            await self._forget(key)
            return
        try:
            await self.inner.close(key, fence)
        finally:
            try:
                await self.directory.unregister(key.session_id)
            except Exception as exc:  # noqa: BLE001 - a stale record is harmless: its owner answers "expired"
                log.warning("directory: could not forget session %s: %s", key.session_id, exc)

    async def _forget(self, key: SessionKey) -> None:
        forget = getattr(self.inner, "forget", None)
        if forget is not None:
            await forget(key)

    def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        return self.inner.events(key)

    async def readiness(self) -> Readiness:
        inner = await self.inner.readiness()
        try:
            await self.directory.start()
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: not ready, with the reason
            return Readiness(inner.live, False, inner.models, (*inner.reasons, f"session directory: {exc}"))
        if self._sweeper is not None and self._sweeping is None:
            self._sweeping = asyncio.create_task(self._sweeper.run(), name="directory-sweep")
        return inner

    async def aclose(self) -> None:
        for task in (self._sweeping, self._watching):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for replicator in list(self._replicators.values()):
            await replicator.aclose()
        self._replicators.clear()
        try:
            await self.inner.aclose()
        finally:
            await self.directory.aclose()
