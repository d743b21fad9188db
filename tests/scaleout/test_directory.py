"""`SessionDirectory` against a real redis-server: records, leases, and orphans claimed exactly once."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from gateway.directory.store import SessionDirectory, lease_key, session_key

LEASE_S = 1.0  # each Redis call attempt is bounded by LEASE_S / 2: room for a loaded CI machine
DEADLINE_S = 15.0  # a stalled test fails here, naming the await it was stuck on (not at pytest-timeout's 300 s)

pytestmark = [pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (requirements/apt.txt)"),
              pytest.mark.timeout(60)]  # a backstop: DEADLINE_S fails first, with a clearer error


@pytest.fixture
async def directories() -> AsyncIterator[list[SessionDirectory]]:
    """Directories a test made; each closed at teardown even if the test failed (`aclose` is idempotent)."""
    made: list[SessionDirectory] = []
    yield made
    async with asyncio.timeout(DEADLINE_S):
        for d in made:
            await d.aclose()


async def test_a_record_names_its_owner_and_replica_while_the_owner_holds_its_lease(
        redis_url: str, raw: redis.Redis, directories: list[SessionDirectory]) -> None:
    a, b = (SessionDirectory(redis_url, addr, LEASE_S) for addr in ("gw-a:8000", "gw-b:8000"))
    directories += [a, b]
    async with asyncio.timeout(DEADLINE_S):
        await a.register("sess_1", "triton-a:8001", 42, 3)
        entry = await b.lookup("sess_1")
        assert entry is not None and (entry.owner, entry.replica, entry.correlation_id, entry.incarnation,
                                      entry.owner_alive) == ("gw-a:8000", "triton-a:8001", 42, 3, True)
        await asyncio.sleep(2 * LEASE_S)  # the lease is refreshed while the gateway runs
        assert (await b.lookup("sess_1")).owner_alive
        assert await b.claim_orphans() == []
        await a.unregister("sess_1")
        assert await b.lookup("sess_1") is None
        await a.aclose()
        assert not await raw.exists(lease_key("gw-a:8000"))  # a clean stop ends the lease at once


async def test_a_dead_owners_sessions_are_claimed_once_among_all_sweepers(
        redis_url: str, raw: redis.Redis, directories: list[SessionDirectory]) -> None:
    live = SessionDirectory(redis_url, "gw-live:8000", LEASE_S)
    sweepers = [SessionDirectory(redis_url, f"gw-{i}:8000", LEASE_S) for i in range(3)]
    directories += [live, *sweepers]
    async with asyncio.timeout(DEADLINE_S):
        for n in range(5):  # what a gateway that died leaves: records, no lease
            await raw.hset(session_key(f"sess_{n}"), mapping={"owner": "gw-dead:8000", "replica": "t:8001",
                                                              "correlation_id": str(n + 1), "incarnation": "1"})
        await live.register("sess_live", "t:8001", 99, 1)
        assert not (await sweepers[0].lookup("sess_0")).owner_alive
        claims = await asyncio.gather(*(s.claim_orphans() for s in sweepers))
        claimed = sorted(e.session_id for batch in claims for e in batch)
        assert claimed == [f"sess_{n}" for n in range(5)]  # each exactly once, the live one never
        assert await sweepers[0].lookup("sess_0") is None
        assert (await sweepers[0].lookup("sess_live")).owner_alive


async def test_a_directory_that_cannot_reach_redis_says_so(directories: list[SessionDirectory]) -> None:
    d = SessionDirectory("redis://127.0.0.1:1/0", "gw:8000", LEASE_S)
    directories.append(d)
    async with asyncio.timeout(DEADLINE_S):
        with pytest.raises(redis.ConnectionError):
            await d.start()
