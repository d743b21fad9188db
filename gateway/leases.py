"""Session leases on a monotonic clock (protocol.md §5.1, §6.2): idle TTL, disconnect grace, heartbeat, reaper.

`LeaseManager` is pure bookkeeping (the clock is injected); `Reaper` is the one background task that every
`reaper_interval_s` hands due expiries to the session code and retries failed cleanups (AD-3). Expiry may
fire up to one interval late, as §5.1 allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class ExpiryReason(enum.StrEnum):
    IDLE = "idle_ttl_expired"
    GRACE = "disconnect_grace_expired"


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    idle_ttl_s: float | None  # None disables idle expiry only (§5.1)
    disconnect_grace_s: float
    reaper_interval_s: float

    def __post_init__(self) -> None:
        if (self.idle_ttl_s is not None and self.idle_ttl_s <= 0) or self.disconnect_grace_s <= 0 \
                or self.reaper_interval_s <= 0:
            raise ValueError("lease limits must be > 0")


@dataclass(slots=True)
class _Lease:
    last_activity: float
    idle_ttl_s: float | None
    detached_at: float | None = None
    generation: int = 1  # lease generation: compare-and-set target of a resume (RS7)
    expired: bool = False


class LeaseManager:
    def __init__(self, config: LeaseConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._leases: dict[str, _Lease] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._leases

    def add(self, session_id: str) -> None:
        self._leases[session_id] = _Lease(self._clock(), self.config.idle_ttl_s)

    def remove(self, session_id: str) -> None:
        self._leases.pop(session_id, None)

    def set_idle_ttl(self, session_id: str, idle_timeout_s: float | None) -> float | None:
        """Session `idle_timeout_s` may only lower the server TTL (§2.2); returns the effective value."""
        lease = self._leases[session_id]
        server = self.config.idle_ttl_s
        if idle_timeout_s is None:
            lease.idle_ttl_s = server
        else:
            lease.idle_ttl_s = idle_timeout_s if server is None else min(server, idle_timeout_s)
        return lease.idle_ttl_s

    def touch(self, session_id: str) -> None:
        """An accepted client event (any, heartbeat included) restarts the idle TTL."""
        lease = self._leases.get(session_id)
        if lease is not None and not lease.expired:
            lease.last_activity = self._clock()

    def heartbeat(self, session_id: str) -> float | None:
        """`session.heartbeat`: touch, then `lease_expires_in_s` for `session.heartbeat_ack`."""
        self.touch(session_id)
        return self.expires_in(session_id)

    def detach(self, session_id: str) -> None:
        lease = self._leases.get(session_id)
        if lease is not None and lease.detached_at is None:
            lease.detached_at = self._clock()

    def attach(self, session_id: str) -> None:
        lease = self._leases.get(session_id)
        if lease is not None:
            lease.detached_at = None

    def generation(self, session_id: str) -> int:
        return self._leases[session_id].generation

    def compare_and_set(self, session_id: str, expected_generation: int) -> bool:
        """One resume wins per lease generation; the loser sees `session_resume_conflict` (RS7)."""
        lease = self._leases.get(session_id)
        if lease is None or lease.expired or lease.generation != expected_generation:
            return False
        lease.generation += 1
        return True

    def _deadline(self, lease: _Lease) -> tuple[float, ExpiryReason] | None:
        options = []
        if lease.idle_ttl_s is not None:
            options.append((lease.last_activity + lease.idle_ttl_s, ExpiryReason.IDLE))
        if lease.detached_at is not None:
            options.append((lease.detached_at + self.config.disconnect_grace_s, ExpiryReason.GRACE))
        return min(options) if options else None

    def expires_in(self, session_id: str) -> float | None:
        lease = self._leases.get(session_id)
        if lease is None:
            return None
        d = self._deadline(lease)
        return None if d is None else max(0.0, d[0] - self._clock())

    def due(self) -> list[tuple[str, ExpiryReason]]:
        """Leases past their deadline, each reported once (it stays registered until `remove`)."""
        now, out = self._clock(), []
        for sid, lease in self._leases.items():
            d = None if lease.expired else self._deadline(lease)
            if d is not None and d[0] <= now:
                lease.expired = True
                out.append((sid, d[1]))
        return out


OnExpire = Callable[[str, ExpiryReason], Awaitable[None]]


class Reaper:
    """Every `interval_s`: start one tracked task per due expiry, then retry due cleanups."""

    def __init__(self, leases: LeaseManager, on_expire: OnExpire,
                 retry_cleanups: Callable[[], Awaitable[object]] | None = None) -> None:
        self._leases, self._on_expire, self._retry = leases, on_expire, retry_cleanups
        self._task: asyncio.Task[None] | None = None
        self._expiring: set[asyncio.Task[None]] = set()  # references kept until each expiry finishes

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="lease-reaper")

    async def run_once(self) -> None:
        for sid, reason in self._leases.due():
            task = asyncio.get_running_loop().create_task(self._expire(sid, reason), name="lease-expiry")
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)
        if self._retry is not None:
            try:
                await self._retry()
            except Exception:  # noqa: BLE001 - the reaper must survive any one cleanup bug
                log.exception("cleanup retry failed")

    async def _expire(self, session_id: str, reason: ExpiryReason) -> None:
        try:
            await self._on_expire(session_id, reason)
        except Exception:  # noqa: BLE001 - one session's expiry never stops the others
            log.exception("expiry handler failed (%s)", reason)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._leases.config.reaper_interval_s)
            await self.run_once()

    async def settle(self) -> None:
        """Wait for the expiries started so far (tests; an orderly drain before shutdown)."""
        if self._expiring:
            await asyncio.gather(*self._expiring, return_exceptions=True)

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._expiring) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
