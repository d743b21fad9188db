"""`SessionDirectory`: the Redis records of live sessions and of the gateways that own them.

Keys (all under `duplex:`):
  duplex:session:<session_id>   hash {owner, replica, correlation_id, incarnation}; written at the runtime open,
                                deleted at close (or by the sweep, once the owner is dead)
  duplex:owner:<addr>           the owner's lease: "1" with a TTL of `lease_s`, refreshed every lease_s / 3
A session's owner is alive while its lease key exists. Only the owner writes its own records; any gateway reads,
and one gateway (the one whose delete wins) sweeps a dead owner's records (`claim_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

PREFIX = "duplex:"
REFRESHES_PER_LEASE = 3  # a lease survives two lost refreshes

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
        self._redis = client
        self._heartbeat: asyncio.Task[None] | None = None

    def _client(self) -> Any:
        if self._redis is None:
            import redis.asyncio as redis  # noqa: PLC0415 - only a gateway with a directory needs the client

            self._redis = redis.Redis.from_url(self.url, decode_responses=True)
        return self._redis

    async def _hold_lease(self) -> None:
        while True:
            try:
                await self._client().set(lease_key(self.addr), "1", px=int(self.lease_s * 1000))
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: try again next beat
                log.warning("directory: lease refresh failed: %s", exc)
            await asyncio.sleep(self.lease_s / REFRESHES_PER_LEASE)

    async def start(self) -> None:
        """Take (or refresh) the lease now, raising if Redis cannot be reached; the first call also starts the
        task that keeps it while this gateway runs."""
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._hold_lease(), name="directory-lease")
        await self._client().set(lease_key(self.addr), "1", px=int(self.lease_s * 1000))

    async def register(self, session_id: str, replica: str, correlation_id: int, incarnation: int) -> None:
        await self.start()
        await self._client().hset(session_key(session_id), mapping={
            "owner": self.addr, "replica": replica, "correlation_id": str(correlation_id),
            "incarnation": str(incarnation)})

    async def unregister(self, session_id: str) -> None:
        await self._client().delete(session_key(session_id))

    async def lookup(self, session_id: str) -> Entry | None:
        fields = await self._client().hgetall(session_key(session_id))
        if not fields:
            return None
        alive = bool(await self._client().exists(lease_key(fields["owner"])))
        return _entry(session_id, fields, alive)

    async def claim_orphans(self) -> list[Entry]:
        """Records whose owner's lease is gone, each deleted here: only the gateway whose delete removed it gets
        it back, so every orphan is handled once even with every gateway sweeping."""
        r, claimed = self._client(), []
        async for key in r.scan_iter(match=session_key("*"), count=256):
            fields = await r.hgetall(key)
            if not fields or await r.exists(lease_key(fields["owner"])):
                continue
            if await r.delete(key):
                claimed.append(_entry(key.removeprefix(session_key("")), fields, False))
        return claimed

    async def aclose(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            with contextlib.suppress(Exception):
                await self._client().delete(lease_key(self.addr))  # a clean stop: the lease ends now
        if self._redis is not None:
            await self._redis.aclose()
