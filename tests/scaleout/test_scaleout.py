"""Beyond one server (issue 20): two Triton replicas, two gateways, one redis-server, all real processes.

Two `duplex serve --only triton` (tiny checkpoint, real engines, max_sessions 3 each) and two
`duplex serve --only gateway` routing over both (DUPLEX_TRITON_REPLICAS) and sharing the session directory in
Redis (DUPLEX_REDIS_URL). Where a session landed is read from each replica's own metrics endpoint (stage0's
`duplex_stage_sessions`), not from a gateway. The tests run in file order: the last two kill a replica and a
gateway (whose sessions another gateway adopts), each seeing the state the one before it left (servers start once
per module).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.runtime.base import Fence, SessionKey
from gateway.runtime.stages import StagedTritonRuntime
from tests.e2e.wire import UNIT0_MS, UNIT_MS, WAIT_S, collect_until, send_audio, silence, unit_decided
from tests.gateway_ops.wire import Raw, eventually, http_get, metric, opened, resume
from tests.scaleout.cluster import Cluster, Gateway, Replica

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LEASE_S = 3.0  # a killed gateway's sessions are known dead this long after its last lease refresh
GRACE_S = 8.0  # the resume grace: a dead gateway's session nobody adopts within it is swept
GATEWAY_ENV = {"DUPLEX_READY_CACHE_S": "0", "DUPLEX_REPLICA_RETRY_S": "1", "DUPLEX_DIRECTORY_LEASE_S": str(LEASE_S),
               "DUPLEX_DISCONNECT_GRACE_S": str(GRACE_S)}
CLOSE_WAIT_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(Path(tmp_path_factory.mktemp("scaleout")), replica_sessions=3, env=GATEWAY_ENV)
    try:
        c.start_replicas(2, wait=False)  # the gateways and redis start while the replicas warm up
        c.start_redis()
        c.start_gateways(2)
        yield c
    finally:
        c.stop()


@pytest.fixture
async def clients() -> AsyncIterator[list[Raw]]:
    """Every client a test opens; their sockets are closed at its end, pass or fail."""
    opened_: list[Raw] = []
    yield opened_
    for c in opened_:
        await c.ws.close()


async def held(replica: Replica) -> int:
    """Sessions the replica's stage0 holds, from its own metrics endpoint."""
    text = (await http_get(f"127.0.0.1:{replica.metrics}", "/metrics")).text
    return int(metric(text, "duplex_stage_sessions", stage="stage0"))


async def counts(cluster: Cluster) -> list[int]:
    return [await held(r) for r in cluster.replicas if r.proc.alive()]


async def open_on(gw: Gateway, cluster: Cluster, clients: list[Raw]) -> tuple[Raw, dict, int]:
    """Open a session through `gw`; returns it, its `session.created` and the (live) replica whose count went up."""
    before = await counts(cluster)
    c, created = await opened(gw.addr)
    clients.append(c)
    after = await counts(cluster)
    grown = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b == a + 1]
    assert len(grown) == 1 and sum(after) == sum(before) + 1, (before, after)
    return c, created, grown[0]


async def decides(c: Raw, unit: int) -> None:
    """Send model unit `unit` (silence) and wait for its decision (the first 3 are forced listens)."""
    await send_audio(c, silence(UNIT0_MS if unit == 0 else UNIT_MS), pace=0)
    await collect_until(c, lambda e: unit_decided(e, unit), WAIT_S)


async def close(c: Raw) -> None:
    await c.send({"type": "session.close"})
    await c.until("session.closed", WAIT_S)


async def test_a_client_dropped_from_one_gateway_resumes_through_the_other(cluster: Cluster,
                                                                           clients: list[Raw]) -> None:
    gw_a, gw_b = cluster.gateways
    c, created, _ = await open_on(gw_a, cluster, clients)
    sid, token = created["session"]["id"], created["resume_token"]
    for unit in range(2):
        await decides(c, unit)
    await c.quiet(0.5)
    seen = c.by_seq()
    assert len(seen) >= 2, c.events
    cursor = min(seen)  # pretend only the first sequenced event was processed
    await c.ws.close()  # dropped without session.close: the session detaches on gateway A

    b, resumed = await resume(gw_b.addr, sid, token, cursor)  # the load balancer sent it to gateway B
    clients.append(b)
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["attachment_generation"] == 2 and resumed["incarnation"] == created["incarnation"]
    assert resumed["resume_token"] != token and resumed["replay_from_seq"] == cursor + 1
    replay = [await b.recv() for _ in range(resumed["replay_count"])]
    assert [e["server_event_seq"] for e in replay] == list(range(cursor + 1, resumed["last_server_event_seq"] + 1))
    assert b.texts[1:len(seen)] == [seen[s] for s in sorted(seen) if s > cursor]  # byte-exact (J-6)
    await decides(b, 2)  # live events follow the replay: the session goes on where it was, on its replica
    for addr in (gw_b.addr, gw_a.addr):  # the old token is refused, through either gateway
        stale, err = await resume(addr, sid, token, 0)
        clients.append(stale)
        assert err["error"]["code"] == "invalid_resume_token", err
    await close(b)
    assert await counts(cluster) == [0, 0]


async def test_sessions_go_where_the_replicas_report_room_and_a_dead_replica_fails_only_its_own(
        cluster: Cluster, clients: list[Raw]) -> None:
    gw, (r0, r1) = cluster.gateways[0], cluster.replicas
    assert await counts(cluster) == [0, 0]
    # A session no gateway here knows about (say a third gateway's) takes one of r0's three slots.
    other = StagedTritonRuntime(r0.spec.split("|")[0])
    other_key = SessionKey("elsewhere", random.getrandbits(62) + 1)
    await other.open(other_key, Fence(1, 0), {})
    try:
        on_r1, _, at = await open_on(gw, cluster, clients)
        assert at == 1  # r1 reports 3 free, r0 2 (a round robin, or a count of its own, would pick r0)
        on_r0, _, at = await open_on(gw, cluster, clients)
        assert at == 0 and await counts(cluster) == [2, 1]  # 2 free each: the first listed
        await decides(on_r1, 0)
        await decides(on_r0, 0)

        # r1 dies: its session gets the typed runtime error and closes; r0's session goes on untouched.
        await asyncio.to_thread(r1.kill)
        assert (await on_r1.until("session.closed", CLOSE_WAIT_S))["reason"] == "runtime_failure"
        errors = [e["error"] for e in on_r1.events if e["type"] == "error"]
        # work in flight may fail first (runtime_stream_failed / runtime_append_failed), then the binding is gone
        assert errors and errors[-1]["code"] == "runtime_dead" and errors[-1]["retryable"] is True
        assert all(e["code"].startswith("runtime_") for e in errors), errors
        await decides(on_r0, 1)
        assert not [e for e in on_r0.events if e["type"] in ("error", "session.closed")]
        assert (await http_get(gw.addr, "/ready")).status_code == 200  # one replica left: still serving

        # New sessions go to the live replica while it has room, and again once it has (the other gateway's leaves).
        extra = await eventually(lambda: _opens(gw, clients), CLOSE_WAIT_S)
        assert await held(r0) == 3
        await other.close(other_key, Fence(1, 0))
        c = await eventually(lambda: _opens(gw, clients), CLOSE_WAIT_S)
        assert await held(r0) == 3
        await decides(c, 0)
        for s in (on_r0, extra, c):
            await close(s)
        assert await held(r0) == 0
    finally:
        await other.aclose()


async def test_a_gateway_cut_off_past_its_lease_ends_the_session_another_gateway_adopted(
        cluster: Cluster, clients: list[Raw]) -> None:
    """Self-fencing: gateway A is paused (SIGSTOP) past its lease, so it counts as dead while its client's socket
    stays open; the client resumes through B, which adopts the session. When A goes on, it finds the record B's and
    ends the session there: its socket gets session.replaced and close 1000 session_replaced (TK-2), and nothing
    reaches the Triton sequence, which goes on through B (and a resume through A is relayed to B)."""
    gw_a, gw_b = cluster.gateways
    r0 = cluster.replicas[0]
    c, created, _ = await open_on(gw_a, cluster, clients)
    sid, token = created["session"]["id"], created["resume_token"]
    for unit in range(2):
        await decides(c, unit)
    await c.quiet(0.5)  # written through
    last = c.last_seq
    await asyncio.to_thread(gw_a.pause)
    try:
        await asyncio.sleep(LEASE_S + 0.5)  # A's lease has run out (its last refresh was at most now - LEASE_S)
        b, resumed = await eventually(lambda: _resumed(gw_b, sid, token, last, clients), 3 * LEASE_S + 6, 0.5)
        assert resumed["attachment_generation"] == 2 and resumed["replay_count"] == 0, resumed
    finally:
        await asyncio.to_thread(gw_a.cont)
    replaced = await c.until("session.replaced", CLOSE_WAIT_S)  # within a lease refresh period of A going on
    assert replaced["attachment_generation"] == 1 and replaced["reason"] == "takeover", replaced
    assert await c.closed() == (1000, "session_replaced")
    assert not [e for e in c.events if e["type"] in ("error", "session.closed")], c.events
    await decides(b, 2)  # the sequence goes on through B: A's end of the session sent nothing to it
    await b.ws.close()
    a2, again = await resume(gw_a.addr, sid, resumed["resume_token"], b.last_seq)  # A holds it no more: relayed
    clients.append(a2)
    assert again["type"] == "session.resumed" and again["attachment_generation"] == 3, again
    await decides(a2, 3)
    await close(a2)
    assert await held(r0) == 0


async def test_a_killed_gateways_sessions_are_adopted_through_another_and_the_unclaimed_swept(
        cluster: Cluster, clients: list[Raw]) -> None:
    gw_a, gw_b = cluster.gateways
    r0 = cluster.replicas[0]
    assert [r.proc.alive() for r in cluster.replicas] == [True, False]  # as the test before left them
    on_a, created_a, _ = await open_on(gw_a, cluster, clients)
    lost_a, created_lost, _ = await open_on(gw_a, cluster, clients)  # its client never comes back
    on_b, created_b, _ = await open_on(gw_b, cluster, clients)
    for unit in range(2):
        await decides(on_a, unit)
    await decides(lost_a, 0)
    await decides(on_b, 0)
    await on_a.quiet(0.5)  # everything A sent has been written through (replica.py: within 10 ms)
    seen = on_a.by_seq()
    cursor = min(seen)  # pretend only the first sequenced event was processed
    sid_a, token_a = created_a["session"]["id"], created_a["resume_token"]
    await asyncio.to_thread(gw_a.kill)

    # Until A's lease runs out (refreshed every LEASE_S / 3, so at least 2 s from now) the directory still names A:
    # B tries to relay the resume, nobody answers: the protocol's retryable resume failure (§6.6 CL-3).
    early, err = await resume(gw_b.addr, sid_a, token_a, cursor)
    clients.append(early)
    assert err["type"] == "error" and err["error"]["code"] == "runtime_resume_failed", err
    assert err["error"]["retryable"] is True and await early.closed() == (1011, "runtime_resume_failed")

    # Gateway B's session is untouched, and stays resumable (a drop, then a resume through B).
    await decides(on_b, 1)
    await on_b.ws.close()
    b, resumed_b = await resume(gw_b.addr, created_b["session"]["id"], created_b["resume_token"], on_b.last_seq)
    clients.append(b)
    assert resumed_b["type"] == "session.resumed" and resumed_b["replay_count"] == 0, resumed_b
    await decides(b, 2)

    # Once A's lease has run out, the client retrying (CL-3) resumes through B, which adopts the session: the
    # replay is A's journal byte for byte, the token rotates, and the session goes on on its replica (r0's slot).
    await asyncio.sleep(LEASE_S)
    a2, resumed = await eventually(lambda: _resumed(gw_b, sid_a, token_a, cursor, clients), 2 * LEASE_S, 0.5)
    assert resumed["attachment_generation"] == 2 and resumed["incarnation"] == created_a["incarnation"]
    assert resumed["resume_token"] != token_a and resumed["replay_from_seq"] == cursor + 1
    assert resumed["last_server_event_seq"] == max(seen) and resumed["replay_count"] == len(seen) - 1
    for _ in range(resumed["replay_count"]):
        await a2.recv()
    assert a2.texts[1:] == [seen[s] for s in sorted(seen) if s > cursor]  # byte-exact (J-6)
    await decides(a2, 2)  # unit 2 on the same Triton sequence: the model clock went on where A left it
    live = [e for e in a2.events[1 + resumed["replay_count"]:] if "server_event_seq" in e]
    assert live[0]["server_event_seq"] == max(seen) + 1  # live events follow the replay without a gap
    assert not [e for e in a2.events if e["type"] in ("error", "session.closed")], a2.events
    stale, err = await resume(gw_b.addr, sid_a, token_a, 0)  # the old token is refused
    clients.append(stale)
    assert err["error"]["code"] == "invalid_resume_token", err
    assert await held(r0) == 3  # A's two (one adopted, one orphaned) and B's: nothing was opened again

    # The session nobody resumed: after the resume grace a sweep closes its sequence, the slot comes free and a
    # late resume gets the protocol's final answer.
    await eventually(lambda: _holds(r0, 2), GRACE_S + 3 * LEASE_S)
    gone, err = await resume(gw_b.addr, created_lost["session"]["id"], created_lost["resume_token"], 0)
    clients.append(gone)
    assert err["type"] == "error" and err["error"]["code"] == "session_resume_expired", err
    await decides(a2, 3)
    for c in (a2, b):
        await close(c)
    assert await held(r0) == 0


async def _resumed(gw: Gateway, sid: str, token: str, cursor: int, clients: list[Raw]) -> tuple[Raw, dict] | None:
    c, first = await resume(gw.addr, sid, token, cursor)
    clients.append(c)
    if first["type"] == "error" and first["error"]["code"] == "runtime_resume_failed":
        return None  # A's lease is not gone yet: retry, as a client does (CL-3)
    assert first["type"] == "session.resumed", first
    return c, first


async def _holds(replica: Replica, n: int) -> bool:
    return await held(replica) == n


async def _opens(gw: Gateway, clients: list[Raw]) -> Raw | None:
    try:
        c, _ = await opened(gw.addr)
    except AssertionError:
        return None  # refused while the dead replica's slot is still being cleaned up
    clients.append(c)
    return c
