"""`SessionDirectory` never waits forever on Redis: a Redis that accepts and never answers is a typed error within
a bound, a lost reply is retried on a fresh connection, and `aclose` ends even when a cancel is dropped.

Fake servers, not redis-server: a real Redis cannot be made to lose a reply on cue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as redis

from gateway.directory.store import ATTEMPTS, SessionDirectory

LEASE_S = 0.3  # each call attempt is bounded by LEASE_S / 2
DEADLINE_S = 3.0  # each test ends well within this, or fails here (not at pytest-timeout's 300 s)

Handler = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def fake_redis(handle: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on a free port; `handle(n, ...)` serves its n-th connection (0-based). Yields the URL and the
    list of connections accepted so far."""
    accepted: list[int] = []
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        writers.append(writer)
        try:
            await handle(accepted[-1], reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", accepted
    finally:
        server.close()
        for writer in writers:  # each handler then reads the end of its stream and returns
            writer.close()
        await asyncio.gather(*tasks)


async def black_hole(_n: int, reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
    while await reader.read(4096):  # reads every command, answers none
        pass


async def answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads RESP commands (arrays of bulk strings) and answers each +OK: enough for SET, HSET, DEL and the
    client's connect handshake (HELLO, CLIENT ...), none of which the client checks beyond an error."""
    while line := await reader.readline():
        for _ in range(int(line[1:])):
            size = int((await reader.readline())[1:])
            await reader.readexactly(size + 2)
        writer.write(b"+OK\r\n")
        await writer.drain()


async def test_a_redis_that_never_answers_is_a_typed_error_within_a_bound_not_a_hang() -> None:
    async with asyncio.timeout(DEADLINE_S) as deadline, fake_redis(black_hole) as (url, accepted):
        d = SessionDirectory(url, "gw:8000", LEASE_S)
        with pytest.raises(redis.TimeoutError):
            await d.register("sess_1", "t:8001", 1, 1)
        with pytest.raises(redis.TimeoutError):
            await d.lookup("sess_1")
        assert len(accepted) >= ATTEMPTS  # each attempt after a lost reply is on a fresh connection
        await d.aclose()
    assert not deadline.expired()


async def test_a_lost_reply_is_sent_again_on_a_fresh_connection() -> None:
    async def first_never_answers(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await (black_hole(n, reader, writer) if n == 0 else answer_ok(reader, writer))

    async with asyncio.timeout(DEADLINE_S) as deadline, fake_redis(first_never_answers) as (url, accepted):
        d = SessionDirectory(url, "gw:8000", LEASE_S)
        try:
            assert await d.unregister("sess_1") is None  # its first DEL gets no reply: sent again, answered
            assert len(accepted) == 2
        finally:
            await d.aclose()
    assert not deadline.expired()


class DropsACancel:
    """A client whose SET drops the first cancel that reaches it and returns as if it had not been cancelled: what
    asyncio.wait_for does on Python 3.11 when a cancel lands just as the awaited send completes (CPython
    gh-86296), which redis-py hits whenever it has a socket_timeout."""

    def __init__(self, until_sets: int = 1) -> None:
        self.sets, self.dropped, self.closed = 0, 0, False
        self.until_sets, self.reached = until_sets, asyncio.Event()  # set once `until_sets` SETs were sent

    async def set(self, *_args: object, **_kwargs: object) -> bool:
        self.sets += 1
        if self.sets >= self.until_sets:
            self.reached.set()
        if self.dropped:
            return True
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.dropped += 1
        return True

    async def delete(self, *_args: object) -> int:
        return 1

    async def aclose(self) -> None:
        self.closed = True


async def test_aclose_ends_even_when_the_heartbeat_drops_its_cancel() -> None:
    client = DropsACancel()
    d = SessionDirectory("redis://unused", "gw:8000", LEASE_S, client=client)
    async with asyncio.timeout(DEADLINE_S) as deadline:
        d._heartbeat = asyncio.create_task(d._hold_lease())  # the heartbeat alone, its first SET in flight
        await client.reached.wait()
        await d.aclose()
    assert not deadline.expired() and client.dropped == 1 and client.closed


class FailsOnce(DropsACancel):
    async def set(self, *_args: object, **_kwargs: object) -> bool:
        self.sets += 1
        if self.sets >= self.until_sets:
            self.reached.set()
        if self.sets == 1:
            raise redis.ConnectionError("Redis restarting")
        return True


async def test_the_heartbeat_keeps_the_lease_through_a_failed_refresh() -> None:
    client = FailsOnce(until_sets=4)
    d = SessionDirectory("redis://unused", "gw:8000", LEASE_S, client=client)
    async with asyncio.timeout(DEADLINE_S) as deadline:
        await d.start()  # SET 1 fails and is sent again at once (SET 2); the heartbeat's beats follow
        await client.reached.wait()
        assert d._heartbeat is not None and not d._heartbeat.done()
        await d.aclose()
    assert not deadline.expired() and client.closed
