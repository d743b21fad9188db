"""`DirectoryRuntime`: any `Runtime`, with each session's open and close written to the shared directory.

The runtime open is where a session gets its replica, so the record is written right after it succeeds (a
failed open leaves nothing behind) and deleted when the runtime close ends, whatever its outcome. While the
session is hosted, its `Replicator` (replica.py) keeps its journal and state in Redis (`replicate`); a session
adopted from a dead gateway is bound to its replica again with `reattach` (adopt.py). Readiness includes the
directory: a gateway that cannot reach Redis could not record new sessions, so it is not ready. The first
readiness probe (a gateway serves nothing before one: the handshake asks too) takes the lease and starts the
sweep (sweep.py). Every session operation is the inner runtime's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.directory.replica import ReplicatedHost, Replicator
from gateway.directory.store import SessionDirectory
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

log = logging.getLogger(__name__)


class DirectoryRuntime:
    def __init__(self, inner: Runtime, directory: SessionDirectory, default_replica: str,
                 sweeper: Sweeper | None = None) -> None:
        self.inner, self.directory, self._default_replica = inner, directory, default_replica
        self._sweeper = sweeper
        self._sweeping: asyncio.Task[None] | None = None
        self._replicators: dict[str, Replicator] = {}

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
        replicator = Replicator(self.directory, sid, host)
        self._replicators[sid] = replicator
        replicator.start()

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
        try:
            await self.inner.close(key, fence)
        finally:
            try:
                await self.directory.unregister(key.session_id)
            except Exception as exc:  # noqa: BLE001 - a stale record is harmless: its owner answers "expired"
                log.warning("directory: could not forget session %s: %s", key.session_id, exc)

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
        if self._sweeping is not None:
            self._sweeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeping
        for replicator in list(self._replicators.values()):
            await replicator.aclose()
        self._replicators.clear()
        try:
            await self.inner.aclose()
        finally:
            await self.directory.aclose()
