"""`ReplicaRuntime`: the `Runtime` protocol over several Triton replicas, one `StagedTritonRuntime` each (issue 20).

A new session goes, at `open`, to the healthy replica with the most free session capacity, read from the
replica itself: every stage model publishes its admission table on Triton's metrics endpoint
(`duplex_stage_sessions` / `duplex_stage_max_sessions`, model_repository/common/occupancy.py); a replica's
room is its fullest stage's. Opens this gateway has sent but the replica has not yet counted are subtracted,
so a burst of opens spreads instead of piling onto one stale figure. The session keeps that replica for its
life (its KV lives there): every later operation and its events go to the same `StagedTritonRuntime`.

Health: every placement probes the replicas: a replica whose metrics page does not answer, or which is not ready
over the gRPC channel its sessions would use, is skipped for `retry_s`, then probed again; one that refuses an
open as full (another gateway took the slot) passes the open to the next. When a replica dies, its sessions'
streams break and each of those sessions alone gets the runtime error the single-replica path gives
(`runtime_dead`); the other replica's sessions never notice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.runtime.base import (
    Fence,
    Readiness,
    Runtime,
    RuntimeEvent,
    RuntimeFailure,
    SessionKey,
    UnitSubmission,
)
from gateway.runtime.stages import STAGES, StagedTritonRuntime

SESSIONS_METRIC = "duplex_stage_sessions"
CAPACITY_METRIC = "duplex_stage_max_sessions"
DEFAULT_METRICS_PORT = 8002  # Triton's default metrics port


@dataclass(frozen=True, slots=True)
class ReplicaEndpoint:
    """One replica: its gRPC address and its metrics URL. Spec: `host:grpc_port[|host:metrics_port]`."""
    grpc: str
    metrics_url: str

    @classmethod
    def parse(cls, spec: str) -> ReplicaEndpoint:
        grpc, _, metrics = spec.strip().partition("|")
        host, sep, port = grpc.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"replica {spec!r}: expected host:grpc_port[|host:metrics_port]")
        metrics = metrics or f"{host}:{DEFAULT_METRICS_PORT}"
        url = metrics if metrics.startswith("http") else f"http://{metrics}/metrics"
        return cls(grpc, url)


@dataclass(frozen=True, slots=True)
class Occupancy:
    held: int
    capacity: int

    @property
    def free(self) -> int:
        return self.capacity - self.held


def parse_occupancy(text: str, stages: tuple[str, ...] = STAGES) -> Occupancy:
    """The fullest stage's (held, capacity) from a Prometheus text page; a stage without figures fails."""
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (SESSIONS_METRIC, CAPACITY_METRIC):
            for sample in family.samples:
                values[(family.name, sample.labels.get("stage", ""))] = sample.value
    per_stage = []
    for stage in stages:
        held, cap = values.get((SESSIONS_METRIC, stage)), values.get((CAPACITY_METRIC, stage))
        if held is None or cap is None:
            raise ValueError(f"no session gauges for stage {stage}")
        per_stage.append(Occupancy(int(held), int(cap)))
    return min(per_stage, key=lambda o: o.free)


@dataclass
class Replica:
    name: str
    endpoint: ReplicaEndpoint
    runtime: Runtime  # a StagedTritonRuntime on that replica
    opening: int = 0  # opens sent, not yet answered: the replica's gauge may not count them yet
    down_until: float = 0.0  # skipped until then (monotonic), after a failed probe
    last: Occupancy | None = field(default=None)

    def usable(self, now: float) -> bool:
        return now >= self.down_until


class ReplicaRuntime:
    def __init__(self, endpoints: tuple[ReplicaEndpoint, ...], ready_models: tuple[str, ...] = STAGES, *,
                 batch_dim: bool = True, probe_timeout_s: float = 2.0, retry_s: float = 5.0,
                 make_runtime: Callable[[ReplicaEndpoint], Runtime] | None = None,
                 http: httpx.AsyncClient | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise ValueError("at least one replica is needed")
        make = make_runtime or (lambda ep: StagedTritonRuntime(ep.grpc, ready_models, batch_dim=batch_dim))
        self.replicas = [Replica(f"r{i}", ep, make(ep)) for i, ep in enumerate(endpoints)]
        self._probe_timeout_s, self._retry_s, self._clock = probe_timeout_s, retry_s, clock
        self._placed: dict[int, Replica] = {}  # correlation id -> its replica, for the session's life
        self._choose = asyncio.Lock()  # one placement at a time, so `opening` is counted before the next reads
        self._http = http

    # ---- placement --------------------------------------------------------------------------------------
    async def _probe(self, replica: Replica) -> Occupancy | None:
        """The replica's room, or None (and skipped for `retry_s`) unless both its metrics page answers and it is
        ready over the gRPC channel the session would use. NOTE: after a replica was unreachable that channel
        reconnects with gRPC's backoff, so metrics alone would route opens into a channel that still refuses."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self._probe_timeout_s)
        page, ready = await asyncio.gather(self._http.get(replica.endpoint.metrics_url),
                                           self._replica_readiness(replica), return_exceptions=True)
        try:
            if isinstance(page, BaseException):
                raise page
            page.raise_for_status()
            if isinstance(ready, BaseException) or not ready.all_ready:
                raise ValueError("not ready")
            replica.last = parse_occupancy(page.text)
        except (httpx.HTTPError, ValueError):
            replica.down_until = self._clock() + self._retry_s
            replica.last = None
        return replica.last

    async def _ranked(self) -> list[Replica]:
        """Usable replicas with room, most free first (free = the replica's figure minus our pending opens)."""
        now = self._clock()
        candidates = [r for r in self.replicas if r.usable(now)]
        found = await asyncio.gather(*(self._probe(r) for r in candidates))
        room = [(occ.free - r.opening, i, r) for i, (r, occ) in enumerate(zip(candidates, found, strict=True))
                if occ is not None and occ.free - r.opening > 0]
        return [r for _, _, r in sorted(room, key=lambda t: (-t[0], t[1]))]

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        """Open on the replica with most room; one that turns out full (another gateway took its last slot since
        it reported) passes the open to the next. Any other refusal is the session's answer."""
        tried: set[str] = set()
        while (replica := await self._reserve(tried)) is not None:
            tried.add(replica.name)
            try:
                await replica.runtime.open(key, fence, config)
            except RuntimeFailure as exc:
                if exc.code != "runtime_backpressure":
                    raise
                continue
            finally:
                replica.opening -= 1  # answered: from now on the replica's own gauge counts it (or not)
            self._placed[key.correlation_id] = replica
            return
        raise RuntimeFailure("runtime_backpressure", "no replica has a free session slot")

    async def _reserve(self, tried: set[str]) -> Replica | None:
        """The best replica not tried yet, its pending opens counted up before the next placement reads them."""
        async with self._choose:
            ranked = [r for r in await self._ranked() if r.name not in tried]
            if not ranked:
                return None
            ranked[0].opening += 1
            return ranked[0]

    def reattach(self, key: SessionKey, grpc: str) -> None:
        """Bind a session another gateway opened on the replica at `grpc` (a dead gateway's, adopted:
        gateway/directory/adopt.py) to a stream of this gateway, so that its operations go there."""
        replica = next((r for r in self.replicas if r.endpoint.grpc == grpc), None)
        if replica is None:
            raise RuntimeFailure("session_not_found", f"replica {grpc} is not one of this gateway's")
        adopt = getattr(replica.runtime, "adopt", None)
        if adopt is None:
            raise RuntimeFailure("session_not_found", "this runtime cannot take over a session")
        adopt(key)
        self._placed[key.correlation_id] = replica

    def replica_of(self, key: SessionKey) -> Replica:
        replica = self._placed.get(key.correlation_id)
        if replica is None:
            raise RuntimeFailure("session_not_found", "no open sequence for this session")
        return replica

    # ---- the session's operations go to its replica -----------------------------------------------------
    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        await self.replica_of(key).runtime.append(key, fence, unit)

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        await self.replica_of(key).runtime.cancel(key, fence, next_fence)

    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        await self.replica_of(key).runtime.update(key, fence, config)

    async def close(self, key: SessionKey, fence: Fence) -> None:
        replica = self.replica_of(key)
        try:
            await replica.runtime.close(key, fence)
        finally:
            self._placed.pop(key.correlation_id, None)

    async def forget(self, key: SessionKey) -> None:
        """Drop this gateway's stream of a session another gateway took over, sending nothing (stages.py)."""
        replica = self._placed.pop(key.correlation_id, None)
        forget = getattr(replica.runtime, "forget", None) if replica is not None else None
        if forget is not None:
            await forget(key)

    async def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        async for ev in self.replica_of(key).runtime.events(key):
            yield ev

    # ---- health -----------------------------------------------------------------------------------------
    async def readiness(self) -> Readiness:
        """Ready while any replica is: new sessions go there. Models and reasons are named per replica."""
        each = await asyncio.gather(*(self._replica_readiness(r) for r in self.replicas))
        models = {f"{r.name}/{m}": ok for r, rd in zip(self.replicas, each, strict=True) for m, ok in rd.models.items()}
        reasons = tuple(f"{r.name}: {why}" for r, rd in zip(self.replicas, each, strict=True) for why in rd.reasons)
        best = next((rd for rd in each if rd.all_ready), None)
        if best is None:
            return Readiness(any(rd.live for rd in each), False, models, reasons)
        # `models` of a ready gateway are the ready replica's: one replica down must not turn /ready red
        return Readiness(True, True, {f"{r.name}/{m}": ok for r, rd in zip(self.replicas, each, strict=True)
                                      if rd.all_ready for m, ok in rd.models.items()}, reasons)

    async def _replica_readiness(self, replica: Replica) -> Readiness:
        try:  # per replica: one hung replica must not make the others look unready
            return await asyncio.wait_for(replica.runtime.readiness(), self._probe_timeout_s)
        except TimeoutError:
            return Readiness(False, False, {m: False for m in STAGES}, ("readiness probe timed out",))

    def placement(self) -> dict[str, int]:
        """Sessions this gateway holds per replica (for logs and tests)."""
        counts = {r.name: 0 for r in self.replicas}
        for replica in self._placed.values():
            counts[replica.name] += 1
        return counts

    async def aclose(self) -> None:
        for r in self.replicas:
            await r.runtime.aclose()
        if self._http is not None:
            await self._http.aclose()
