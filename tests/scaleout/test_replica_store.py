"""The write-through copy of a session in Redis (gateway/directory/replica.py) against a real redis-server: the
journal's exact bytes trimmed as the in-memory journal is, the state and config, read back into a new session
(adopt.py's path), the takeover / sweep race decided once, an owner finding its record taken over or swept
(self-fencing), and the copy's expiry."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as redis

from gateway.directory.adopt import _token_matches, adopt
from gateway.directory.replica import Replicator, host_state, parse_entry
from gateway.directory.runtime import DirectoryRuntime
from gateway.directory.store import (
    Ownership,
    SessionDirectory,
    config_key,
    journal_key,
    lease_key,
    session_key,
    session_keys,
    state_key,
)
from gateway.protocol.config import ConfigContext, default_config, response_defaults
from gateway.protocol.errors import ProtocolError
from gateway.resume.attachment import Attachments
from gateway.resume.credentials import ResumeCredential
from gateway.resume.journal import Journal, JournalConfig
from gateway.runtime.base import Fence, SessionKey
from gateway.session import snapshot
from gateway.session.core import SessionLimits
from gateway.session.outbox import Outbox, OutboxLimits
from gateway.session.runtime_config import RuntimeDefaults
from gateway.session.session import DuplexSession
from gateway.session.units import UnitGeometry
from gateway.ws.messages import OwnerLost

LEASE_S = 1.0
DEADLINE_S = 15.0

pytestmark = [pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (requirements/apt.txt)"),
              pytest.mark.timeout(60)]


@pytest.fixture
async def directory(redis_url: str) -> AsyncIterator[SessionDirectory]:
    d = SessionDirectory(redis_url, "gw-a:8000", LEASE_S)
    yield d
    await d.aclose()


CTX = ConfigContext(served_model="m", model_aliases=(), voices=("default",), default_voice_available=True,
                    idle_ttl_s=300.0, force_listen_count=0, default_input_rate_hz=24000,
                    default_output_format="pcm16")


def new_session(sid: str = "sess_1", outbox: Outbox | None = None, **config: Any) -> DuplexSession:
    cfg = dataclasses.replace(default_config(CTX), **config)
    limits = SessionLimits(max_pending_input_bytes=1 << 20, max_pending_turns=4, runtime_timeout_s=1.0,
                           close_ack_timeout_s=1.0, idle_ttl_s=300.0)
    return DuplexSession(session_id=sid, incarnation=2, config=cfg, ctx=CTX, limits=limits, runtime=None,  # type: ignore[arg-type]
                         key=SessionKey(sid, 77), outbox=outbox if outbox is not None else Outbox(OutboxLimits(1 << 20, 512, 1 << 16, 8)),
                         post_lane=lambda r: None, clock=time.monotonic, geometry=UnitGeometry(),
                         runtime_defaults=RuntimeDefaults(), capabilities={}, limits_json={})


@dataclass
class Host:
    """What a LiveSession lends the replicator."""
    session: DuplexSession | None
    route: str = "/v1/realtime"
    profile: str = "ga"
    journal: Journal = field(default_factory=lambda: Journal(JournalConfig(60.0, 4096)))
    credential: ResumeCredential = field(default_factory=lambda: ResumeCredential.issue()[0])
    attachments: Attachments = field(default_factory=lambda: Attachments(resumable=True))


async def settled(rep: Replicator) -> None:
    """Until every noted change is written (the replicator writes at most every 10 ms)."""
    for _ in range(200):
        await asyncio.sleep(0.02)
        if not rep._pending and not rep._wake.is_set():  # noqa: SLF001 - the test's view of "nothing queued"
            return
    raise AssertionError("the replicator did not settle")


def event(seq: int, n: int = 40) -> bytes:
    return json.dumps({"type": "x", "server_event_seq": seq, "pad": "é" * n}).encode()


async def test_the_journal_in_redis_is_the_journal_in_memory_and_reads_back_byte_exact(
        directory: SessionDirectory, raw: redis.Redis) -> None:
    async with asyncio.timeout(DEADLINE_S):
        await directory.register("sess_1", "t:8001", 77, 2)
        host = Host(new_session(instructions="be brief"))
        rep = Replicator(directory, "sess_1", host)
        rep.start()
        for seq in range(1, 11):
            assert host.journal.offer(seq, event(seq))
        host.journal.ack(4)  # J-2: 1..4 leave memory and Redis
        assert host.journal.offer(11, event(11))
        await settled(rep)
        stored = await raw.hgetall(journal_key("sess_1"))
        now = time.time()
        assert sorted(int(s) for s in stored) == list(range(5, 12))
        assert {int(s): parse_entry(v, now)[0] for s, v in stored.items()} == dict(host.journal.entries())
        record = await raw.hgetall(session_key("sess_1"))
        assert (record["journal_last_seq"], record["journal_acked_seq"], record["owner"]) == ("11", "4", "gw-a:8000")
        state = json.loads(await raw.get(state_key("sess_1")))
        assert state["host"] == host_state(host) and state["session"]["epoch"] == 0
        assert json.loads(await raw.get(config_key("sess_1")))["instructions"] == "be brief"
        writes = rep.writes
        assert writes < 11  # bursts share a pipeline

        # what a new owner reads back: the same bytes, the same replay after any cursor (J-6)
        rec, journal, _, _ = await directory.load("sess_1")
        copy = Journal(JournalConfig(60.0, 4096))
        copy.restore(((int(s), *parse_entry(v, time.time())) for s, v in journal.items()),
                     last_seq=int(rec["journal_last_seq"]), acked_seq=int(rec["journal_acked_seq"]),
                     aged_out_seq=int(rec["journal_aged_seq"]))
        for cursor in (4, 7, 11):
            assert copy.replay(cursor) == host.journal.replay(cursor)
        await rep.aclose()


async def test_an_overflowed_journal_leaves_redis_and_the_copy_says_not_resumable(
        directory: SessionDirectory, raw: redis.Redis) -> None:
    async with asyncio.timeout(DEADLINE_S):
        await directory.register("sess_1", "t:8001", 77, 2)
        host = Host(new_session())
        rep = Replicator(directory, "sess_1", host)
        rep.start()
        seq = 1
        while host.journal.offer(seq, event(seq, 400)):  # the cap (4096 bytes) bounds Redis as it bounds memory
            seq += 1
        await settled(rep)
        assert not await raw.exists(journal_key("sess_1"))
        assert json.loads(await raw.get(state_key("sess_1")))["host"]["resumable"] is False
        await rep.aclose()


async def test_a_token_rotation_is_written_at_once(directory: SessionDirectory, raw: redis.Redis) -> None:
    async with asyncio.timeout(DEADLINE_S):
        await directory.register("sess_1", "t:8001", 77, 2)
        host = Host(new_session())
        rep = Replicator(directory, "sess_1", host)
        rep.start()
        await settled(rep)
        rotation = host.credential.prepare_rotation()
        host.credential.commit_rotation(rotation)  # no journaled event follows: the change alone is written
        await settled(rep)
        stored = json.loads(await raw.get(state_key("sess_1")))["host"]
        assert bytes.fromhex(stored["digest"]) == rotation.digest and stored["previous"] is not None
        await rep.aclose()


async def test_a_session_state_survives_the_copy_and_the_response_in_flight_ends_cancelled() -> None:
    a = new_session(instructions="keep it short", temperature=0.5)
    resp = a.responses.open_response("model", response_defaults(a.config), precreated=False, input_item_id=None)
    a.responses.speak(resp, 3)
    a.inputs.feed.restore(next_unit=7, clock_ms=7030.0)
    state = json.loads(json.dumps(snapshot.capture(a)))
    config = snapshot.config_from_json(json.loads(json.dumps(snapshot.config_json(a.config))))
    assert config == a.config

    outbox = Outbox(OutboxLimits(1 << 20, 512, 1 << 16, 8))
    b = new_session(outbox=outbox, **{k: getattr(config, k) for k in ("instructions", "temperature", "seed")})
    snapshot.restore(b, state)
    assert b.responses.active is not None and b.responses.active.id == resp.id
    assert [i.id for i in b.responses.history.items()] == [i.id for i in a.responses.history.items()]
    assert (b.inputs.feed.cutter.next_index, b.inputs.feed.clock_ms) == (7, 7030.0)
    b.responses.cancel_orphan("owner_gateway_lost", next_epoch=1)
    assert b.responses.epoch == 1 and b.responses.active is None and b.responses.model_turn_id == 1
    items = [await outbox.get() for _ in range(len(outbox))]
    done = [ev for item in items for ev in item.events if ev["type"] == "response.done"]
    assert done, [ev["type"] for item in items for ev in item.events]
    assert done[0]["response"]["status"] == "cancelled"
    assert done[0]["response"]["duplex"]["reason"] == "owner_gateway_lost"


async def test_a_dead_owners_session_is_taken_over_once_and_never_swept_after(
        redis_url: str, raw: redis.Redis) -> None:
    gws = [SessionDirectory(redis_url, f"gw-{i}:8000", LEASE_S) for i in range(3)]
    try:
        async with asyncio.timeout(DEADLINE_S):
            await raw.hset(session_key("sess_1"), mapping={"owner": "gw-dead:8000", "replica": "t:8001",
                                                           "correlation_id": "5", "incarnation": "1"})
            await raw.set(state_key("sess_1"), "{}")
            await raw.set(lease_key("gw-live:8000"), "1")
            assert not await gws[0].take_over("sess_1", "gw-live:8000")  # a live owner is never taken over
            wins = await asyncio.gather(*(g.take_over("sess_1", "gw-dead:8000") for g in gws))
            assert sorted(wins) == [False, False, True]
            winner = gws[wins.index(True)]
            await winner.start()  # its lease: the record is alive again
            assert (await gws[0].lookup("sess_1")).owner == winner.addr
            assert await gws[1].claim_orphans(0.0) == []
            await winner.give_back("sess_1", "gw-dead:8000")  # an adoption that failed half-way
            assert (await gws[0].lookup("sess_1")).owner == "gw-dead:8000"
    finally:
        for g in gws:
            await g.aclose()


async def test_the_sweep_waits_for_the_resume_grace_then_forgets_everything(
        directory: SessionDirectory, raw: redis.Redis) -> None:
    async with asyncio.timeout(DEADLINE_S):
        await raw.hset(session_key("sess_1"), mapping={"owner": "gw-dead:8000", "replica": "t:8001",
                                                       "correlation_id": "5", "incarnation": "1"})
        await raw.hset(journal_key("sess_1"), mapping={"1": "0 {}"})
        await raw.set(state_key("sess_1"), "{}")
        await raw.set(config_key("sess_1"), "{}")
        assert await directory.claim_orphans(0.5) == []  # first seen orphaned: the grace starts
        assert await directory.claim_orphans(0.5) == []
        await asyncio.sleep(0.6)
        assert [e.session_id for e in await directory.claim_orphans(0.5)] == ["sess_1"]
        assert not await raw.exists(*session_keys("sess_1"))


async def test_an_abandoned_copy_expires_and_a_live_one_does_not(redis_url: str, raw: redis.Redis) -> None:
    """The backstop of a copy nobody sweeps (every gateway dead): each key expires `copy_ttl_s` after its owner last
    wrote or checked it; a live owner's ownership check (once per lease refresh period) renews them."""
    ttl_s = 1.0
    d = SessionDirectory(redis_url, "gw-a:8000", LEASE_S, copy_ttl_s=ttl_s)
    try:
        async with asyncio.timeout(DEADLINE_S):
            reps = {}
            for sid in ("live", "abandoned"):
                await d.register(sid, "t:8001", 77, 2)
                host = Host(new_session(sid))
                reps[sid] = rep = Replicator(d, sid, host)
                rep.start()
                assert host.journal.offer(1, event(1))
                await settled(rep)
                await rep.aclose()  # "abandoned" stays so: its gateway died
                assert await raw.exists(*session_keys(sid)) == 4
                ttls = [await raw.pttl(k) for k in session_keys(sid)]
                assert all(0 < t <= ttl_s * 1000 for t in ttls), ttls  # the write set every key's TTL
            for _ in range(5):  # the live owner checks its session every lease_s / 3
                await asyncio.sleep(ttl_s / 3)
                assert await d.check_owned(["live"]) == {"live": Ownership.MINE}
            assert await raw.exists(*session_keys("abandoned")) == 0
            assert await raw.exists(*session_keys("live")) == 4
            assert 0 < await raw.pttl(session_key("live")) <= ttl_s * 1000
    finally:
        await d.aclose()


async def test_an_owner_learns_that_its_record_was_taken_over_or_swept(
        directory: SessionDirectory, raw: redis.Redis) -> None:
    async with asyncio.timeout(DEADLINE_S):
        for sid in ("kept", "moved", "gone"):
            await directory.register(sid, "t:8001", 77, 2)
        await raw.hset(session_key("kept"), "orphaned_at", "1")  # a sweep saw it while its owner was cut off
        await raw.hset(session_key("moved"), "owner", "gw-b:8000")  # adopted by gw-b meanwhile
        await raw.delete(session_key("gone"))  # swept
        found = await directory.check_owned(["kept", "moved", "gone"])
        assert found == {"kept": Ownership.MINE, "moved": Ownership.MOVED, "gone": Ownership.GONE}
        assert not await raw.hexists(session_key("kept"), "orphaned_at")  # its owner is back: the mark goes

        # the write-through finds out too, stops, and says so
        lost: list[tuple[str, Ownership]] = []
        rep = Replicator(directory, "moved", Host(new_session("moved")), on_lost=lambda s, o: lost.append((s, o)))
        rep.start()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if lost:
                break
        assert lost == [("moved", Ownership.MOVED)] and rep.lost and rep.writes == 0
        assert not await raw.exists(state_key("moved"))  # gw-b's record was not written over
        await rep.aclose()


class FakeInner:
    """The inner runtime of a DirectoryRuntime, recording what reaches it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def close(self, key: SessionKey, fence: Fence) -> None:
        self.calls.append("close")

    async def forget(self, key: SessionKey) -> None:
        self.calls.append("forget")

    async def aclose(self) -> None:
        pass


@dataclass
class PostingHost(Host):
    posted: list[Any] = field(default_factory=list)

    def post(self, msg: Any) -> None:
        self.posted.append(msg)


async def test_a_gateway_that_lost_a_session_ends_it_without_touching_its_sequence_or_record(
        redis_url: str, raw: redis.Redis) -> None:
    """Self-fencing (gateway/directory/runtime.py): the ownership check finds the record another gateway's; the
    session's host is told, and its close drops only the local stream: no runtime close, no record delete."""
    directory = SessionDirectory(redis_url, "gw-a:8000", 0.3)
    inner = FakeInner()
    rt = DirectoryRuntime(inner, directory, "t:8001")  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(DEADLINE_S):
            hosts = {}
            for sid in ("adopted", "swept", "mine"):
                await directory.register(sid, "t:8001", 77, 2)
                hosts[sid] = PostingHost(new_session(sid))
                rt.replicate(hosts[sid])
            await raw.hset(session_key("adopted"), "owner", "gw-b:8000")
            await raw.delete(*session_keys("swept"))
            for _ in range(100):  # the check runs every lease_s / 3
                await asyncio.sleep(0.05)
                if hosts["adopted"].posted and hosts["swept"].posted:
                    break
            assert hosts["adopted"].posted == [OwnerLost(moved=True)]
            assert hosts["swept"].posted == [OwnerLost(moved=False)]
            assert hosts["mine"].posted == []
            await rt.close(SessionKey("adopted", 77), Fence(2, 0))
            assert inner.calls == ["forget"]  # nothing went to the sequence gw-b holds now
            assert (await raw.hget(session_key("adopted"), "owner")) == "gw-b:8000"  # gw-b's record stands
            await rt.close(SessionKey("mine", 77), Fence(2, 0))  # a session still its own closes as ever
            assert inner.calls == ["forget", "close"] and not await raw.exists(session_key("mine"))
    finally:
        await rt.aclose()


async def test_a_resume_with_a_wrong_token_does_not_take_a_dead_owners_session_over(
        directory: SessionDirectory, raw: redis.Redis) -> None:
    """Adoption checks the resume token against the copy (RS3) before it takes the record: a resume that only knows
    the session id neither moves the session nor cancels its response (gateway/directory/adopt.py)."""
    credential, token = ResumeCredential.issue()
    host = host_state(Host(session=None, credential=credential))
    gw = SimpleNamespace(directory=directory, host_factory=lambda route, profile: None)
    async with asyncio.timeout(DEADLINE_S):
        await raw.hset(session_key("sess_1"), mapping={"owner": "gw-dead:8000", "replica": "t:8001",
                                                       "correlation_id": "5", "incarnation": "1"})
        await raw.set(state_key("sess_1"), json.dumps({"host": host, "session": {}}))
        entry = await directory.lookup("sess_1")
        assert entry is not None and not entry.owner_alive
        with pytest.raises(ProtocolError) as err:
            await adopt(gw, entry, "x" * len(token))  # type: ignore[arg-type]
        assert err.value.code == "invalid_resume_token"
        assert (await directory.lookup("sess_1")).owner == "gw-dead:8000"  # not taken over
        assert _token_matches({"host": host}, token)
