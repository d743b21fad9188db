"""`SessionDirectory`: the Redis records of live sessions and of the gateways that own them.

Keys (all under `duplex:`):
  duplex:session:<session_id>   hash {owner, replica, correlation_id, incarnation, journal_last_seq,
                                journal_acked_seq, journal_aged_seq[, orphaned_at]}; written at the runtime open,
                                the journal position with every write-through (replica.py), deleted at close (or by
                                the sweep, once the owner is dead and the resume grace has passed)
  duplex:journal:<session_id>   hash {seq: "<wall ms> <exact event text>"}: the resume journal, trimmed as the
                                owner's in-memory journal is (replica.py)
  duplex:state:<session_id>     JSON: the session's state a new owner needs (replica.py, gateway/session/snapshot.py)
  duplex:config:<session_id>    JSON: the session config as the client last set it
  duplex:owner:<addr>           the owner's lease: "1" with a TTL of `lease_s`, refreshed every lease_s / 3
A session's owner is alive while its lease key exists. Only the owner writes its own records; any gateway reads.
Every key of a session expires `copy_ttl_s` after its owner last wrote or checked it (a backstop: with every gateway
dead nobody sweeps, and the copy must not stay for ever); a live owner renews them at every write and every
ownership check (`check_owned`, once per lease refresh period), so only an abandoned copy expires.
An owner that finds its record taken over or gone (`Ownership`: a write, or `check_owned`) was counted dead, say
cut off from Redis past its lease: it ends the session locally (gateway/directory/runtime.py, self-fencing).
A dead owner's session is either taken over by the gateway a resume reaches (`take_over`, gateway/directory/
adopt.py) or, once it has been orphaned for the resume grace, swept by one gateway (`claim_orphans`); both are
one atomic script each, so exactly one of them wins.

Every Redis call is bounded (`SessionDirectory.call_timeout_s`): a gateway never waits forever on Redis. A call
that gets no reply in time, or whose connection drops, is sent once more on a fresh connection; then it raises a
`redis.RedisError` (`redis.TimeoutError` for no reply), which the callers turn into a protocol error or a log line.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

PREFIX = "duplex:"
REFRESHES_PER_LEASE = 3  # a lease survives two lost refreshes
ATTEMPTS = 2  # a call whose reply is lost is sent once more before it fails
SCAN_COUNT = 256
COPY_TTL_MARGIN = 3  # the copies' default TTL: this many times (lease + resume grace + replay TTL)
DEFAULT_COPY_TTL_S = COPY_TTL_MARGIN * (10.0 + 30.0 + 60.0)  # with the settings' defaults of those three


def default_copy_ttl_s(lease_s: float, grace_s: float, replay_ttl_s: float) -> float:
    """Long enough that a dead gateway's copy outlives every resume the protocol could still accept (its lease
    running out, then the resume grace; the journal's entries live resume_replay_ttl_s), with a margin."""
    return COPY_TTL_MARGIN * (lease_s + grace_s + replay_ttl_s)


class Ownership(enum.IntEnum):
    """What the owner of a session finds when it writes or checks its record."""
    MOVED = -1  # another gateway took the record over (adopt.py)
    GONE = 0  # no record: swept, closed by an adopter, or expired
    MINE = 1

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


def journal_key(session_id: str) -> str:
    return f"{PREFIX}journal:{session_id}"


def state_key(session_id: str) -> str:
    return f"{PREFIX}state:{session_id}"


def config_key(session_id: str) -> str:
    return f"{PREFIX}config:{session_id}"


def session_keys(session_id: str) -> tuple[str, ...]:
    """Every key of one session (its record first)."""
    return session_key(session_id), journal_key(session_id), state_key(session_id), config_key(session_id)


# KEYS: the session's keys (record first), then the dead owner's lease. ARGV: the dead owner, the new owner, the
# copy's TTL (ms). 1 = taken over.
TAKE_OVER = """
local lease = KEYS[#KEYS]
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] or redis.call('EXISTS', lease) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
redis.call('HDEL', KEYS[1], 'orphaned_at')
for i = 1, #KEYS - 1 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return 1
"""
# The write-through of one session (replica.py), one command: applied only while this gateway owns the record (a
# gateway that lost it, say cut off from Redis past its lease, cannot overwrite the new owner's copy).
# KEYS: record, journal, state, config. ARGV: owner, the copy's TTL (ms), overflowed (0/1), journal last/acked/aged
# seq, state JSON, config JSON ("" = unchanged), n, n x (seq, entry) to add, then the seqs to delete. Returns an
# `Ownership`: 1 = written (and every key's TTL renewed), 0 = no record, -1 = another gateway's record.
WRITE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return 0 end
if owner ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], 'journal_last_seq', ARGV[4], 'journal_acked_seq', ARGV[5], 'journal_aged_seq', ARGV[6])
redis.call('SET', KEYS[3], ARGV[7])
if ARGV[8] ~= '' then redis.call('SET', KEYS[4], ARGV[8]) end
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[2])
else
  local n = tonumber(ARGV[9])
  for i = 10, 9 + 2 * n, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  for i = 10 + 2 * n, #ARGV do redis.call('HDEL', KEYS[2], ARGV[i]) end
end
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return 1
"""
# KEYS: the four keys of each session (record first), session after session. ARGV: owner, the copy's TTL (ms).
# One `Ownership` per session; an owned record loses a stale orphan mark (its owner is back: the sweep's grace must
# start afresh if it dies later) and all four keys get their TTL renewed.
OWNED = """
local out = {}
for i = 1, #KEYS, 4 do
  local owner = redis.call('HGET', KEYS[i], 'owner')
  if not owner then out[#out + 1] = 0
  elseif owner ~= ARGV[1] then out[#out + 1] = -1
  else
    redis.call('HDEL', KEYS[i], 'orphaned_at')
    for j = i, i + 3 do redis.call('PEXPIRE', KEYS[j], ARGV[2]) end
    out[#out + 1] = 1
  end
end
return out
"""
# KEYS: the record. ARGV: this gateway, the dead owner. Undoes TAKE_OVER.
GIVE_BACK = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
return 1
"""
# KEYS: the session's keys (record first), then the dead owner's lease. ARGV: the dead owner, now (wall ms), the
# grace (ms). Marks the record orphaned the first time; deletes it, once orphaned that long. 1 = deleted here.
SWEEP = """
local lease = KEYS[#KEYS]
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] or redis.call('EXISTS', lease) == 1 then return 0 end
local at = redis.call('HGET', KEYS[1], 'orphaned_at')
if not at then
  redis.call('HSET', KEYS[1], 'orphaned_at', ARGV[2])
  at = ARGV[2]
end
if tonumber(ARGV[2]) - tonumber(at) < tonumber(ARGV[3]) then return 0 end
for i = 1, #KEYS - 1 do redis.call('DEL', KEYS[i]) end
return 1
"""


def lease_key(addr: str) -> str:
    return f"{PREFIX}owner:{addr}"


class SessionDirectory:
    def __init__(self, url: str, addr: str, lease_s: float, *, copy_ttl_s: float = DEFAULT_COPY_TTL_S,
                 client: Any = None) -> None:
        self.url, self.addr, self.lease_s = url, addr, lease_s
        self.copy_ttl_ms = str(int(copy_ttl_s * 1000))
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
        return await self._bounded(method, lambda: getattr(self._client(), method)(*args, **kwargs), idempotent)

    async def _bounded(self, name: str, send: Callable[[], Awaitable[Any]], idempotent: bool) -> Any:
        from redis.exceptions import ConnectionError as LostConnection  # noqa: PLC0415 - see _client
        from redis.exceptions import TimeoutError as NoReply  # noqa: PLC0415

        for attempt in range(1, ATTEMPTS if idempotent else 1):
            try:
                return await self._attempt(name, send)
            except (LostConnection, NoReply) as exc:
                log.info("directory: Redis %s attempt %d failed (%s), trying again", name, attempt, exc)
        return await self._attempt(name, send)

    async def _attempt(self, name: str, send: Callable[[], Awaitable[Any]]) -> Any:
        from redis.exceptions import TimeoutError as NoReply  # noqa: PLC0415 - see _client

        try:
            # a timeout cancels the command mid-read: redis-py then drops that connection, so a late reply can
            # never be read as the answer to a later command
            async with asyncio.timeout(self.call_timeout_s):
                return await send()
        except TimeoutError as exc:  # asyncio's, raised as redis-py's own typed error
            raise NoReply(f"Redis {name}: no reply within {self.call_timeout_s:.3g}s") from exc

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

        async def write() -> Any:
            pipe = self._client().pipeline(transaction=True)
            pipe.hset(session_key(session_id), mapping={"owner": self.addr, "replica": replica,
                                                        "correlation_id": str(correlation_id),
                                                        "incarnation": str(incarnation)})
            pipe.pexpire(session_key(session_id), int(self.copy_ttl_ms))
            return await pipe.execute()

        await self._bounded("register", write, True)

    async def unregister(self, session_id: str) -> None:
        await self._call("delete", *session_keys(session_id))

    async def write_through(self, session_id: str, args: list[str]) -> Ownership:
        """One session's changes (replica.py builds `args` as WRITE's ARGV after the owner and the TTL), written
        only while this gateway owns the record. Retried like any idempotent call (every part sets or deletes
        absolute values)."""
        keys = session_keys(session_id)
        return Ownership(int(await self._call("eval", WRITE, len(keys), *keys, self.addr, self.copy_ttl_ms, *args)))

    async def check_owned(self, session_ids: list[str]) -> dict[str, Ownership]:
        """Whether each of these sessions (this gateway's) is still this gateway's; renews the owned ones' TTL and
        clears their orphan mark. One script for all of them."""
        if not session_ids:
            return {}
        keys = [k for sid in session_ids for k in session_keys(sid)]
        found = await self._call("eval", OWNED, len(keys), *keys, self.addr, self.copy_ttl_ms)
        return {sid: Ownership(int(o)) for sid, o in zip(session_ids, found, strict=True)}

    async def take_over(self, session_id: str, dead_owner: str) -> bool:
        """Make this gateway the owner of a session whose owner's lease is gone; False if the owner is alive, or
        another gateway took it over (or swept it) first. Not retried: a lost reply must not turn a win into 0."""
        keys = (*session_keys(session_id), lease_key(dead_owner))
        return bool(await self._call("eval", TAKE_OVER, len(keys), *keys, dead_owner, self.addr, self.copy_ttl_ms,
                                     idempotent=False))

    async def give_back(self, session_id: str, dead_owner: str) -> None:
        """Undo `take_over` (an adoption that failed half-way): the record names the dead owner again."""
        await self._call("eval", GIVE_BACK, 1, session_key(session_id), self.addr, dead_owner)

    async def load(self, session_id: str) -> tuple[dict[str, str], dict[str, str], str | None, str | None]:
        """A session's record, journal, state and config as stored (empty / None where absent)."""
        async def read() -> Any:
            pipe = self._client().pipeline(transaction=True)
            for key in (session_key(session_id), journal_key(session_id)):
                pipe.hgetall(key)
            for key in (state_key(session_id), config_key(session_id)):
                pipe.get(key)
            return await pipe.execute()

        record, journal, state, config = await self._bounded("load", read, True)
        return record, journal, state, config

    async def state(self, session_id: str) -> str | None:
        """The session's state as written through (replica.py), or None."""
        return await self._call("get", state_key(session_id))

    async def lookup(self, session_id: str) -> Entry | None:
        fields = await self._call("hgetall", session_key(session_id))
        if not fields:
            return None
        alive = bool(await self._call("exists", lease_key(fields["owner"])))
        return _entry(session_id, fields, alive)

    async def claim_orphans(self, grace_s: float = 0.0) -> list[Entry]:
        """Records whose owner's lease is gone and that nobody took over within `grace_s` (the resume grace) since a
        sweep first saw them orphaned, each deleted here with its journal and state: only the gateway whose delete
        removed it gets it back, so every orphan is handled once even with every gateway sweeping."""
        claimed, cursor = [], 0
        now_ms = int(time.time() * 1000)  # wall clock: the mark is compared by other processes
        while True:
            cursor, keys = await self._call("scan", cursor, match=session_key("*"), count=SCAN_COUNT)
            for key in keys:
                fields = await self._call("hgetall", key)
                if not fields or await self._call("exists", lease_key(fields["owner"])):
                    continue
                sid = key.removeprefix(session_key(""))
                # one script: the owner and its lease are checked again where the mark and the delete happen, so a
                # takeover (adopt.py) or another sweeper's delete in between is never undone. Not retried: a delete
                # whose reply was lost may have removed the record, and a second one would answer 0 and hide that;
                # the round fails instead (the sweeper logs it) and the next claims the rest
                keys_ = (*session_keys(sid), lease_key(fields["owner"]))
                if await self._call("eval", SWEEP, len(keys_), *keys_, fields["owner"], str(now_ms),
                                    str(int(grace_s * 1000)), idempotent=False):
                    claimed.append(_entry(sid, fields, False))
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
