"""Gateway-managed admission (protocol.md §5.2): a table of `max_sessions` slots with states.

A slot is taken by one atomic check-and-reserve in the open transaction (AD-1) and counts while the session
is open, detached or closing. It is freed only after runtime cleanup has succeeded (AD-3); a failing or
blocked cleanup keeps its slot and is retried with backoff by the reaper (`retry_due`), each cleanup under
its own deadline so one stuck session never delays another's. Resume and takeover take no slot (AD-5).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.protocol.errors import Effect, ProtocolError

log = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]


class SlotState(enum.StrEnum):
    OPEN = "open"
    DETACHED = "detached"
    CLOSING = "closing"  # cleanup started or pending retry; still holds the slot


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_sessions: int
    # close_ack_timeout_s: a slower cleanup counts as failed, so session.closed is not held back longer and
    # goes out with cleanup_pending:true while the slot stays held (§3.10 X5)
    cleanup_timeout_s: float = 10.0
    retry_base_s: float = 0.5  # first retry delay; doubles per failure
    retry_max_s: float = 5.0  # reaper_interval_s: retries never spread further apart than the reaper cadence

    def __post_init__(self) -> None:
        if self.max_sessions <= 0 or self.cleanup_timeout_s <= 0 or self.retry_base_s <= 0:
            raise ValueError("admission limits must be > 0")
        if self.retry_max_s < self.retry_base_s:
            raise ValueError("retry_max_s must be >= retry_base_s")


@dataclass(slots=True)
class _Slot:
    state: SlotState = SlotState.OPEN
    cleanup: Cleanup | None = None
    failures: int = 0
    next_retry_at: float = 0.0
    running: bool = False


def capacity_error(limit: int) -> ProtocolError:
    """The refusal at capacity: a retryable `rate_limit_error`, close 1013 (AD-2, from the code table)."""
    return ProtocolError("resource_exhausted", f"duplex_session_capacity_exhausted: limit={limit}",
                         effect=Effect.HANDSHAKE)


class Admission:
    def __init__(self, config: AdmissionConfig, *, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[dict[str, int]], None] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._on_change = on_change
        self._slots: dict[str, _Slot] = {}

    # ---- queries -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._slots

    def state_of(self, session_id: str) -> SlotState | None:
        slot = self._slots.get(session_id)
        return None if slot is None else slot.state

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in SlotState}
        for slot in self._slots.values():
            out[slot.state.value] += 1
        return out

    def live(self) -> int:
        """Sessions holding a slot that are not closing (open or detached): the load a unit alignment follows."""
        return len(self._slots) - self.counts()[SlotState.CLOSING.value]

    def cleanup_pending(self) -> list[str]:
        return [sid for sid, s in self._slots.items() if s.state is SlotState.CLOSING and not s.running]

    # ---- transitions ---------------------------------------------------------------------------------
    def reserve(self, session_id: str) -> None:
        """One check-and-reserve counting open, detached and closing sessions (AD-1); synchronous, so atomic
        on the event loop. Raises `resource_exhausted`."""
        if session_id in self._slots:
            raise ValueError(f"slot for {session_id!r} already held")  # the registry rejects live ids first
        if len(self._slots) >= self.config.max_sessions:
            # a full replica is a normal state: logged at INFO, not as an error (AD-2)
            log.info("admission refused: %d/%d slots held", len(self._slots), self.config.max_sessions)
            raise capacity_error(self.config.max_sessions)
        self._slots[session_id] = _Slot()
        self._changed()

    def rollback(self, session_id: str) -> None:
        """Undo a reserve inside a failed open transaction (nothing was opened in the runtime)."""
        if self._slots.pop(session_id, None) is not None:
            self._changed()

    def set_state(self, session_id: str, state: SlotState) -> None:
        """open <-> detached; `closing` is entered only through `close`."""
        slot = self._slots.get(session_id)
        if slot is None or slot.state is SlotState.CLOSING or state is SlotState.CLOSING:
            return
        slot.state = state
        self._changed()

    async def close(self, session_id: str, cleanup: Cleanup) -> bool:
        """Enter `closing`, try the cleanup once now. True when it succeeded and the slot was freed."""
        slot = self._slots.get(session_id)
        if slot is None:
            return True
        slot.state, slot.cleanup = SlotState.CLOSING, cleanup
        self._changed()
        return await self._attempt(session_id, slot)

    async def retry_due(self) -> list[str]:
        """Reaper hook: retry every due cleanup concurrently. Returns the ids whose slot was freed."""
        now = self._clock()
        due = [(sid, s) for sid, s in self._slots.items()
               if s.state is SlotState.CLOSING and not s.running and s.cleanup is not None and s.next_retry_at <= now]
        if not due:
            return []
        results = await asyncio.gather(*(self._attempt(sid, s) for sid, s in due))
        return [sid for (sid, _), ok in zip(due, results, strict=True) if ok]

    async def _attempt(self, session_id: str, slot: _Slot) -> bool:
        assert slot.cleanup is not None
        if slot.running:
            return False
        slot.running = True
        try:
            async with asyncio.timeout(self.config.cleanup_timeout_s):
                await slot.cleanup()
        except Exception as exc:  # noqa: BLE001 - any failure (incl. TimeoutError) keeps the slot (AD-3)
            slot.failures += 1
            delay = min(self.config.retry_max_s, self.config.retry_base_s * 2 ** (slot.failures - 1))
            slot.next_retry_at = self._clock() + delay
            log.warning("cleanup of a session failed (%s, attempt %d); retry in %.1fs",
                        exc.__class__.__name__, slot.failures, delay)
            return False
        finally:
            slot.running = False
        if self._slots.get(session_id) is slot:
            del self._slots[session_id]
            self._changed()
        return True

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.counts())
