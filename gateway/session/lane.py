"""The per-session runtime lane: the ordered append tail (protocol.md §4.5) plus cancel ordering.

Appends are submitted strictly one after another, each waiting for its predecessor's ack (A-1).
The fence is stamped at submission time, so audio admitted before a cancellation still reaches the
model under the new epoch. A cancel is sent at once (it travels ahead of queued data, STYLE §8) and
the next append waits for the cancel's ack, so the runtime never sees an E+1 append before the
E -> E+1 cancel. Results go back to the session actor as messages; the lane owns only its queue,
its in-flight accounting and the pending-bytes counter (§5.1).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass

from gateway.runtime.base import Fence, Runtime, RuntimeFailure, SessionKey, UnitSubmission


@dataclass(frozen=True, slots=True)
class AppendAcked:
    unit: UnitSubmission
    wire_bytes: int
    commit_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AppendFailed:
    unit: UnitSubmission
    wire_bytes: int
    commit_ids: tuple[int, ...]
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class CancelFailed:
    code: str
    message: str


LaneResult = AppendAcked | AppendFailed | CancelFailed


@dataclass(slots=True)
class _Queued:
    unit: UnitSubmission
    wire_bytes: int
    commit_ids: tuple[int, ...]


class RuntimeLane:
    def __init__(self, runtime: Runtime, key: SessionKey, fence_of: Callable[[], Fence],
                 post: Callable[[LaneResult], None], max_pending_bytes: int, timeout_s: float) -> None:
        self._runtime, self._key, self._fence_of, self._post = runtime, key, fence_of, post
        self._max_pending = max_pending_bytes
        self._timeout_s = timeout_s
        self._queue: collections.deque[_Queued] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_submit: Callable[[int], None] = lambda unit_index: None  # metrics observer (gateway.ws.meters)
        self._cancels: list[asyncio.Task[None]] = []
        self.pending_bytes = 0
        self.acked_appends = 0
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def restore(self, *, acked_appends: int) -> None:
        """An adopted session (gateway/session/snapshot.py): the appends its earlier owner had acknowledged."""
        self.acked_appends = acked_appends

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lane:{self._key.session_id}")

    def can_reserve(self, nbytes: int) -> bool:
        return self.pending_bytes + nbytes <= self._max_pending

    def submit(self, unit: UnitSubmission, wire_bytes: int, commit_ids: tuple[int, ...] = ()) -> None:
        self.pending_bytes += wire_bytes
        self.on_submit(unit.unit_index)
        self._queue.append(_Queued(unit, wire_bytes, commit_ids))
        self._idle.clear()
        self._wake.set()

    def drop_queued(self) -> list[tuple[int, ...]]:
        """input.cancel: forget unsubmitted appends; returns their commit ids."""
        dropped = list(self._queue)
        self._queue.clear()
        for q in dropped:
            self.pending_bytes -= q.wire_bytes
        return [q.commit_ids for q in dropped if q.commit_ids]

    def cancel(self, fence: Fence, next_fence: Fence) -> None:
        self._cancels = [t for t in self._cancels if not t.done()]  # answered ones (with no append after them)
        self._cancels.append(asyncio.create_task(self._cancel(fence, next_fence), name="lane-cancel"))
        self._wake.set()

    async def drain(self) -> None:
        """Wait until every append admitted so far has been acknowledged or failed (§2.7 U3), and every cancel sent
        so far answered: an update carries the session's current fence, whose epoch the runtime adopts only with
        that cancel (stage0 refuses an epoch it never adopted)."""
        await self._idle.wait()
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)  # each posts its own failure

    async def _cancel(self, fence: Fence, next_fence: Fence) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._runtime.cancel(self._key, fence, next_fence)
        except RuntimeFailure as exc:
            self._post(CancelFailed(exc.code, exc.message))
        except TimeoutError:
            self._post(CancelFailed("runtime_timeout", "cancel timed out"))

    async def _run(self) -> None:
        while not self._closed:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._cancels:
                # The runtime must adopt the next fence before it sees an append stamped with it.
                pending, self._cancels = self._cancels, []
                await asyncio.gather(*pending)
                continue  # the queue may have been dropped meanwhile (input.cancel, close): look again
            q = self._queue.popleft()
            base = self._fence_of()
            fence = Fence(base.incarnation, base.epoch, self.acked_appends + 1)
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._runtime.append(self._key, fence, q.unit)
            except RuntimeFailure as exc:
                self.pending_bytes -= q.wire_bytes
                self._post(AppendFailed(q.unit, q.wire_bytes, q.commit_ids, exc.code, exc.message))
                continue
            except TimeoutError:
                self.pending_bytes -= q.wire_bytes
                self._post(AppendFailed(q.unit, q.wire_bytes, q.commit_ids, "timeout", "append timed out"))
                continue
            except Exception as exc:  # noqa: BLE001 - one broken request fails only that append
                self.pending_bytes -= q.wire_bytes
                self._post(AppendFailed(q.unit, q.wire_bytes, q.commit_ids, "internal_error", repr(exc)))
                continue
            self.pending_bytes -= q.wire_bytes
            self.acked_appends += 1
            self._post(AppendAcked(q.unit, q.wire_bytes, q.commit_ids))

    async def aclose(self) -> None:
        # NOTE: the flag, not only cancel(): a cancel racing an append's completion must still end the loop.
        self._closed = True
        self._wake.set()
        tasks = [t for t in (self._task, *self._cancels) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # nothing is sent any more: a later drain() (a retried cleanup) must not wait for a queue nobody runs
        self._queue.clear()
        self._idle.set()
