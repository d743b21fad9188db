"""`ReplicaRuntime` placement and health on fabricated replicas: metric pages served by httpx's MockTransport,
per-replica runtimes recording what reaches them. The real tritonservers are in test_scaleout.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest

from gateway.runtime.base import Fence, Readiness, RuntimeEvent, RuntimeFailure, SessionKey, UnitSubmission
from gateway.runtime.replicas import Occupancy, ReplicaEndpoint, ReplicaRuntime, parse_occupancy

STAGES = ("stage0", "tts", "token2wav")
FENCE = Fence(1, 0)


def page(held: Mapping[str, int], cap: Mapping[str, int]) -> str:
    lines = ["# TYPE duplex_stage_sessions gauge"]
    lines += [f'duplex_stage_sessions{{stage="{s}"}} {n}' for s, n in held.items()]
    lines += ["# TYPE duplex_stage_max_sessions gauge"]
    lines += [f'duplex_stage_max_sessions{{stage="{s}"}} {n}' for s, n in cap.items()]
    return "\n".join(lines) + "\n"


class FakeReplica:
    """What one replica's runtime was asked; its metrics page follows the sessions it holds."""

    def __init__(self, capacity: int, held: int = 0) -> None:
        self.capacity, self.extra = capacity, held  # `extra`: sessions other gateways hold there
        self.sessions: set[int] = set()
        self.calls: list[tuple[str, int]] = []
        self.refuse: str | None = None
        self.gate: asyncio.Event | None = None
        self.reachable, self.ready = True, True

    def metrics(self) -> str:
        n = len(self.sessions) + self.extra
        return page(dict.fromkeys(STAGES, n), dict.fromkeys(STAGES, self.capacity))

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        self.calls.append(("open", key.correlation_id))
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse:
            raise RuntimeFailure(self.refuse, "refused")
        self.sessions.add(key.correlation_id)

    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        self.calls.append(("append", key.correlation_id))

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        self.calls.append(("cancel", key.correlation_id))

    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        self.calls.append(("update", key.correlation_id))

    async def close(self, key: SessionKey, fence: Fence) -> None:
        self.calls.append(("close", key.correlation_id))
        self.sessions.discard(key.correlation_id)

    async def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        return
        yield

    async def readiness(self) -> Readiness:
        return Readiness(self.ready, self.ready, dict.fromkeys(STAGES, self.ready))

    async def aclose(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def runtime(*replicas: FakeReplica, clock: Clock | None = None) -> ReplicaRuntime:
    by_host = {f"r{i}": r for i, r in enumerate(replicas)}

    def serve(request: httpx.Request) -> httpx.Response:
        replica = by_host[request.url.host]
        if not replica.reachable:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text=replica.metrics())

    endpoints = tuple(ReplicaEndpoint.parse(f"r{i}:8001") for i in range(len(replicas)))
    fakes = iter(replicas)
    return ReplicaRuntime(endpoints, make_runtime=lambda _ep: next(fakes), retry_s=5.0,
                          http=httpx.AsyncClient(transport=httpx.MockTransport(serve)), clock=clock or Clock())


def key(n: int) -> SessionKey:
    return SessionKey(f"s{n}", n)


def test_endpoint_specs() -> None:
    assert ReplicaEndpoint.parse("t:8001") == ReplicaEndpoint("t:8001", "http://t:8002/metrics")
    assert ReplicaEndpoint.parse("t:8001|m:9") == ReplicaEndpoint("t:8001", "http://m:9/metrics")
    assert ReplicaEndpoint.parse("t:1|https://m/x").metrics_url == "https://m/x"
    for bad in ("t", "t:", ":8001", "t:port"):
        with pytest.raises(ValueError):
            ReplicaEndpoint.parse(bad)


def test_a_replicas_room_is_its_fullest_stage() -> None:
    text = page({"stage0": 1, "tts": 3, "token2wav": 0}, {"stage0": 4, "tts": 4, "token2wav": 8})
    assert parse_occupancy(text) == Occupancy(3, 4) and parse_occupancy(text).free == 1
    with pytest.raises(ValueError):
        parse_occupancy(page({"stage0": 0}, {"stage0": 4}))  # a stage that publishes nothing is no capacity


async def test_each_session_goes_to_the_replica_reporting_most_room_and_stays_there() -> None:
    small, big = FakeReplica(2), FakeReplica(4, held=1)  # free 2 and 3
    rt = runtime(small, big)
    await rt.open(key(1), FENCE, {})  # 2 vs 3
    await rt.open(key(2), FENCE, {})  # 2 vs 2: the first listed
    await rt.open(key(3), FENCE, {})  # 1 vs 2
    assert (small.sessions, big.sessions) == ({2}, {1, 3})
    await rt.append(key(2), FENCE, UnitSubmission(0, b""))
    await rt.cancel(key(2), FENCE, FENCE.next())
    await rt.update(key(2), FENCE, {})
    await rt.close(key(2), FENCE)
    assert [c for c in small.calls if c[1] == 2] == [(op, 2) for op in ("open", "append", "cancel", "update",
                                                                         "close")]
    with pytest.raises(RuntimeFailure) as exc:
        await rt.append(key(2), FENCE, UnitSubmission(1, b""))  # closed: no replica any more
    assert exc.value.code == "session_not_found"
    assert rt.placement() == {"r0": 0, "r1": 2}


async def test_opens_in_flight_count_against_a_replica_before_it_reports_them() -> None:
    a, b = FakeReplica(1), FakeReplica(1)
    a.gate = b.gate = asyncio.Event()  # the replicas have not counted the opens yet
    rt = runtime(a, b)
    opens = [asyncio.create_task(rt.open(key(n), FENCE, {})) for n in (1, 2)]
    await asyncio.sleep(0.01)
    a.gate.set()
    await asyncio.gather(*opens)
    assert (len(a.sessions), len(b.sessions)) == (1, 1)


async def test_a_replica_full_after_all_passes_the_open_to_the_next_and_none_with_room_refuses() -> None:
    raced, spare = FakeReplica(4), FakeReplica(2)
    raced.refuse = "runtime_backpressure"  # another gateway took its slots after it reported them
    rt = runtime(raced, spare)
    await rt.open(key(1), FENCE, {})
    assert spare.sessions == {1} and raced.calls == [("open", 1)]
    await rt.open(key(2), FENCE, {})  # raced still reports 4 free, refuses; spare has its last slot
    with pytest.raises(RuntimeFailure) as exc:
        await rt.open(key(3), FENCE, {})  # only `raced` reports room, and it refuses
    assert exc.value.code == "runtime_backpressure"
    raced.capacity = 0
    with pytest.raises(RuntimeFailure) as exc:
        await rt.open(key(4), FENCE, {})  # nobody reports room: refused without asking
    assert exc.value.code == "runtime_backpressure" and ("open", 4) not in raced.calls + spare.calls


async def test_other_open_failures_are_not_retried_elsewhere() -> None:
    bad, good = FakeReplica(4), FakeReplica(2)
    bad.refuse = "invalid_runtime_config"
    rt = runtime(bad, good)
    with pytest.raises(RuntimeFailure) as exc:
        await rt.open(key(1), FENCE, {})
    assert exc.value.code == "invalid_runtime_config" and good.calls == []


async def test_an_unreachable_replica_is_skipped_until_its_retry_time() -> None:
    clock = Clock()
    down, up = FakeReplica(8), FakeReplica(2)
    down.reachable = False
    rt = runtime(down, up, clock=clock)
    await rt.open(key(1), FENCE, {})
    assert up.sessions == {1}
    down.reachable = True
    clock.now = 4.9
    await rt.open(key(2), FENCE, {})  # still marked down: not even probed
    assert up.sessions == {1, 2}
    clock.now = 5.0
    await rt.open(key(3), FENCE, {})  # probed again: room
    assert down.sessions == {3}


async def test_a_replica_not_ready_over_grpc_gets_no_session_though_its_metrics_answer() -> None:
    clock = Clock()
    reconnecting, up = FakeReplica(8), FakeReplica(2)
    reconnecting.ready = False  # e.g. its gRPC channel still in reconnect backoff after a restart
    rt = runtime(reconnecting, up, clock=clock)
    await rt.open(key(1), FENCE, {})
    assert up.sessions == {1} and reconnecting.calls == []
    reconnecting.ready, clock.now = True, 5.0
    await rt.open(key(2), FENCE, {})
    assert reconnecting.sessions == {2}


async def test_ready_while_any_replica_is_ready() -> None:
    a, b = FakeReplica(1), FakeReplica(1)
    rt = runtime(a, b)
    a.ready = False
    r = await rt.readiness()
    assert r.all_ready and set(r.models) == {f"r1/{s}" for s in STAGES}
    b.ready = False
    r = await rt.readiness()
    assert not r.ready and not r.all_ready
