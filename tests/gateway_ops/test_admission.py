from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Admission, AdmissionConfig, SlotState
from gateway.protocol.errors import CloseCode, ErrorClass, ProtocolError, handshake_close_code

from .conftest import FakeClock


def make(clock: FakeClock, n: int = 2, **kw: float) -> tuple[Admission, list[dict[str, int]]]:
    seen: list[dict[str, int]] = []
    return Admission(AdmissionConfig(n, **kw), clock=clock, on_change=seen.append), seen


def test_limit_then_resource_exhausted(clock: FakeClock) -> None:
    adm, _ = make(clock, 2)
    adm.reserve("a")
    adm.reserve("b")
    with pytest.raises(ProtocolError) as ei:
        adm.reserve("c")
    err = ei.value
    assert err.code == "resource_exhausted"
    assert err.message == "duplex_session_capacity_exhausted: limit=2"
    assert err.spec.cls is ErrorClass.RATE_LIMIT and err.spec.retryable
    assert handshake_close_code(err.code) is CloseCode.TRY_AGAIN
    assert len(adm) == 2


def test_counts_open_detached_closing(clock: FakeClock) -> None:
    adm, seen = make(clock, 3)
    for sid in "abc":
        adm.reserve(sid)
    adm.set_state("b", SlotState.DETACHED)
    assert adm.counts() == {"open": 2, "detached": 1, "closing": 0}
    assert adm.live() == 3  # open and detached sessions go on making units
    assert seen[-1] == adm.counts()
    adm.set_state("b", SlotState.OPEN)
    assert adm.state_of("b") is SlotState.OPEN


def test_rollback_frees_slot(clock: FakeClock) -> None:
    adm, _ = make(clock, 1)
    adm.reserve("a")
    adm.rollback("a")
    adm.reserve("b")
    assert "b" in adm and "a" not in adm


async def test_successful_cleanup_frees_slot_and_replacement_is_admitted(clock: FakeClock) -> None:
    adm, _ = make(clock, 1)
    adm.reserve("a")
    calls = []

    async def cleanup() -> None:
        calls.append("a")

    assert await adm.close("a", cleanup) is True
    assert calls == ["a"] and len(adm) == 0
    adm.reserve("b")  # AD-4: the replacement is not refused because of the old session


async def test_failed_cleanup_keeps_slot_and_retries_with_backoff(clock: FakeClock) -> None:
    adm, _ = make(clock, 1, retry_base_s=1.0, retry_max_s=4.0)
    adm.reserve("a")
    attempts = 0

    async def flaky() -> None:
        nonlocal attempts
        attempts += 1
        if attempts < 4:
            raise RuntimeError("triton down")

    assert await adm.close("a", flaky) is False
    assert adm.state_of("a") is SlotState.CLOSING
    assert (len(adm), adm.live()) == (1, 0)  # a closing session holds its slot but is not live
    with pytest.raises(ProtocolError):  # AD-3: the closing session still holds its slot
        adm.reserve("b")
    assert await adm.retry_due() == []  # not due yet (backoff 1 s)
    assert attempts == 1
    clock.advance(1.0)
    assert await adm.retry_due() == [] and attempts == 2  # next delay 2 s
    clock.advance(1.5)
    assert await adm.retry_due() == [] and attempts == 2
    clock.advance(0.5)
    assert await adm.retry_due() == [] and attempts == 3  # next delay min(4, 4) = 4 s
    clock.advance(4.0)
    assert await adm.retry_due() == ["a"] and attempts == 4
    assert len(adm) == 0
    adm.reserve("b")


async def test_blocked_cleanup_times_out_and_does_not_block_others(clock: FakeClock) -> None:
    adm, _ = make(clock, 2, cleanup_timeout_s=0.05, retry_base_s=0.01, retry_max_s=0.01)
    adm.reserve("stuck")
    adm.reserve("ok")
    never = asyncio.Event()

    async def blocked() -> None:
        await never.wait()

    async def fine() -> None:
        return None

    ok_first = []

    async def close_ok_after_stuck_starts() -> None:
        await asyncio.sleep(0)
        ok_first.append(await adm.close("ok", fine))

    stuck_result, _ = await asyncio.gather(adm.close("stuck", blocked), close_ok_after_stuck_starts())
    assert stuck_result is False and ok_first == [True]
    assert adm.state_of("stuck") is SlotState.CLOSING and "ok" not in adm


async def test_closing_state_not_left_by_set_state(clock: FakeClock) -> None:
    adm, _ = make(clock, 1, retry_base_s=10.0, retry_max_s=10.0)
    adm.reserve("a")

    async def fail() -> None:
        raise OSError("x")

    await adm.close("a", fail)
    adm.set_state("a", SlotState.OPEN)
    assert adm.state_of("a") is SlotState.CLOSING
    assert adm.cleanup_pending() == ["a"]


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(0)
    with pytest.raises(ValueError):
        AdmissionConfig(1, retry_base_s=2.0, retry_max_s=1.0)
