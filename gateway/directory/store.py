"""`SessionDirectory`: the Redis records of live sessions and of the gateways that own them.

Keys (all under `duplex:`):
  duplex:session:<session_id>   hash {owner, replica, correlation_id, incarnation}; written at the runtime open,
                                deleted at close (or by the sweep, once the owner is dead)
  duplex:owner:<addr>           the owner's lease: "1" with a TTL of `lease_s`, refreshed every lease_s / 3
A session's owner is alive while its lease key exists. Only the owner writes its own records; any gateway reads,
and one gateway (the one whose delete wins) sweeps a dead owner's records (`claim_orphans`).

Every Redis call is bounded (`SessionDirectory.call_timeout_s`): a gateway never waits forever on Redis. A call
that gets no reply in time, or whose connection drops, is sent once more on a fresh connection; then it raises a
`redis.RedisError` (`redis.TimeoutError` for no reply), which the callers turn into a protocol error or a log line.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

PREFIX = "duplex:"
REFRESHES_PER_LEASE = 3  # a lease survives two lost refreshes
ATTEMPTS = 2  # a call whose reply is lost is sent once more before it fails
SCAN_COUNT = 256

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Entry:
    session_id: str
    owner: str  # the owning gateway's address (host:port), as other gateways reach it
    replica: str  # the Triton replica's gRPC address holding the session's KV
    correlation_id: int
    incarnation: int
    owner_alive: bool


def _entry(session_id: str, fields: dict[str, str], alive: bool) -> Entry:
    return Entry(session_id, fields["owner"], fields["replica"], int(fields["correlation_id"]),
                 int(fields.get("incarnation", "1")), alive)


def session_key(session_id: str) -> str:
    return f"{PREFIX}session:{session_id}"


def lease_key(addr: str) -> str:
    return f"{PREFIX}owner:{addr}"


class SessionDirectory:
    def __init__(self, url: str, addr: str, lease_s: float, *, client: Any = None) -> None:
        self.url, self.addr, self.lease_s = url, addr, lease_s
        # half a lease per attempt, so a call gives up within about one lease (ATTEMPTS): waiting longer is
        # pointless (a refresh that late has lost the lease anyway), and a shorter bound fails calls spuriously when
        # the gateway's own loop stalls for a second under load (seen with lease / 3 on a 2-core CI machine)
        self.call_timeout_s = lease_s / ATTEMPTS
        self._redis = client
        self._heartbeat: asyncio.Task[None] | None = None
        self._closing = False

    def _client(self) -> Any:
        if self._redis is None:
            import redis.asyncio as redis  # noqa: PLC0415 - only a gateway with a directory needs the client

            # NOTE: socket_timeout=None on purpose, the bound is `_call`'s asyncio.timeout. With a socket_timeout,
            # redis-py sends each command under asyncio.wait_for, which on Python 3.11 drops a cancel that lands just
            # as the send completes (CPython gh-86296): the cancelled task runs on as if nothing happened (that left
            # `aclose` waiting forever on a heartbeat that kept beating). The connect keeps its own bound.
            self._redis = redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=None,
                                               socket_connect_timeout=self.call_timeout_s)
        return self._redis

    async def _call(self, method: str, *args: Any, idempotent: bool = True, **kwargs: Any) -> Any:
        """`client.<method>(*args, **kwargs)`, each attempt within `call_timeout_s`; an idempotent call is tried
        ATTEMPTS times. No reply raises `redis.TimeoutError`, a lost connection `redis.ConnectionError`."""
        from redis.exceptions import ConnectionError as LostConnection  # noqa: PLC0415 - see _client
        from redis.exceptions import TimeoutError as NoReply  # noqa: PLC0415

        for attempt in range(1, ATTEMPTS if idempotent else 1):
            try:
                return await self._attempt(method, *args, **kwargs)
            except (LostConnection, NoReply) as exc:
                log.info("directory: Redis %s attempt %d failed (%s), trying again", method, attempt, exc)
        return await self._attempt(method, *args, **kwargs)

    async def _attempt(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from redis.exceptions import TimeoutError as NoReply  # noqa: PLC0415 - see _client

        try:
            # a timeout cancels the command mid-read: redis-py then drops that connection, so a late reply can
            # never be read as the answer to a later command
            async with asyncio.timeout(self.call_timeout_s):
                return await getattr(self._client(), method)(*args, **kwargs)
        except TimeoutError as exc:  # asyncio's, raised as redis-py's own typed error
            raise NoReply(f"Redis {method}: no reply within {self.call_timeout_s:.3g}s") from exc

    async def _refresh_lease(self) -> None:
        await self._call("set", lease_key(self.addr), "1", px=int(self.lease_s * 1000))

    async def _hold_lease(self) -> None:
        while not self._closing:  # NOTE: checked as well as cancelled: see `_stop_heartbeat`
            try:
                await self._refresh_lease()
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: try again next beat
                log.warning("directory: lease refresh failed: %s", exc)
            await asyncio.sleep(self.lease_s / REFRESHES_PER_LEASE)

    async def start(self) -> None:
        """Take (or refresh) the lease now, raising if Redis cannot be reached; the first call also starts the
        task that keeps it while this gateway runs."""
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._hold_lease(), name="directory-lease")
        await self._refresh_lease()

    async def register(self, session_id: str, replica: str, correlation_id: int, incarnation: int) -> None:
        await self.start()
        await self._call("hset", session_key(session_id), mapping={
            "owner": self.addr, "replica": replica, "correlation_id": str(correlation_id),
            "incarnation": str(incarnation)})

    async def unregister(self, session_id: str) -> None:
        await self._call("delete", session_key(session_id))

    async def lookup(self, session_id: str) -> Entry | None:
        fields = await self._call("hgetall", session_key(session_id))
        if not fields:
            return None
        alive = bool(await self._call("exists", lease_key(fields["owner"])))
        return _entry(session_id, fields, alive)

    async def claim_orphans(self) -> list[Entry]:
        """Records whose owner's lease is gone, each deleted here: only the gateway whose delete removed it gets
        it back, so every orphan is handled once even with every gateway sweeping."""
        claimed, cursor = [], 0
        while True:
            cursor, keys = await self._call("scan", cursor, match=session_key("*"), count=SCAN_COUNT)
            for key in keys:
                fields = await self._call("hgetall", key)
                if not fields or await self._call("exists", lease_key(fields["owner"])):
                    continue
                # not retried: a delete whose reply was lost may have removed the record, and a second one would
                # answer 0 and hide that; the round fails instead (the sweeper logs it) and the next claims the rest
                if await self._call("delete", key, idempotent=False):
                    claimed.append(_entry(key.removeprefix(session_key("")), fields, False))
            if cursor == 0:
                return claimed

    async def _stop_heartbeat(self, task: asyncio.Task[None]) -> None:
        # NOTE: cancel() alone is not a stop: a cancel can be dropped inside a client library (see `_client`), and
        # `await task` would then wait for ever on a heartbeat that keeps beating. `_closing` ends its loop at the
        # next beat, and the cancel is repeated each refresh period until the task is done.
        self._closing = True
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=self.lease_s / REFRESHES_PER_LEASE)

    async def aclose(self) -> None:
        """Stop refreshing, end the lease (a clean stop), close the client; bounded like every call here."""
        task, self._heartbeat = self._heartbeat, None
        if task is not None:
            await self._stop_heartbeat(task)
            try:
                await self._call("delete", lease_key(self.addr))  # a clean stop: the lease ends now
            except Exception as exc:  # noqa: BLE001 - Redis away: the lease runs out on its own within lease_s
                log.warning("directory: could not end the lease: %s", exc)
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()
