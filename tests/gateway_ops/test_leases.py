from __future__ import annotations

import asyncio

import pytest

from gateway.leases import ExpiryReason, LeaseConfig, LeaseManager, Reaper

from .conftest import FakeClock

CFG = LeaseConfig(idle_ttl_s=300.0, disconnect_grace_s=30.0, reaper_interval_s=5.0)


def test_idle_ttl_expiry_and_touch(clock: FakeClock) -> None:
    lm = LeaseManager(CFG, clock)
    lm.add("s")
    clock.advance(299.0)
    assert lm.due() == []
    lm.touch("s")  # an accepted client event restarts the TTL
    clock.advance(299.0)
    assert lm.due() == []
    clock.advance(1.0)
    assert lm.due() == [("s", ExpiryReason.IDLE)]
    assert lm.due() == []  # reported once


def test_disconnect_grace_and_reattach(clock: FakeClock) -> None:
    lm = LeaseManager(CFG, clock)
    lm.add("s")
    lm.detach("s")
    clock.advance(20.0)
    lm.attach("s")  # resumed in time: the grace timer is cancelled
    clock.advance(20.0)
    assert lm.due() == []
    lm.detach("s")
    clock.advance(29.9)
    assert lm.due() == []
    clock.advance(0.1)
    assert lm.due() == [("s", ExpiryReason.GRACE)]


def test_detach_twice_keeps_first_deadline(clock: FakeClock) -> None:
    lm = LeaseManager(CFG, clock)
    lm.add("s")
    lm.detach("s")
    clock.advance(20.0)
    lm.detach("s")
    assert lm.expires_in("s") == pytest.approx(10.0)


def test_earliest_deadline_wins(clock: FakeClock) -> None:
    lm = LeaseManager(LeaseConfig(idle_ttl_s=10.0, disconnect_grace_s=30.0, reaper_interval_s=1.0), clock)
    lm.add("s")
    lm.detach("s")
    clock.advance(10.0)
    assert lm.due() == [("s", ExpiryReason.IDLE)]


def test_idle_none_disables_idle_only(clock: FakeClock) -> None:
    lm = LeaseManager(LeaseConfig(idle_ttl_s=None, disconnect_grace_s=30.0, reaper_interval_s=1.0), clock)
    lm.add("s")
    clock.advance(1e6)
    assert lm.due() == [] and lm.expires_in("s") is None
    lm.detach("s")
    clock.advance(30.0)
    assert lm.due() == [("s", ExpiryReason.GRACE)]


def test_session_idle_timeout_only_lowers(clock: FakeClock) -> None:
    lm = LeaseManager(CFG, clock)
    lm.add("s")
    assert lm.set_idle_ttl("s", 1000.0) == 300.0
    assert lm.set_idle_ttl("s", 60.0) == 60.0
    assert lm.heartbeat("s") == pytest.approx(60.0)
    clock.advance(45.0)
    assert lm.heartbeat("s") == pytest.approx(60.0)  # heartbeat refreshes the idle TTL
    assert lm.set_idle_ttl("s", None) == 300.0


def test_lease_compare_and_set(clock: FakeClock) -> None:
    lm = LeaseManager(CFG, clock)
    lm.add("s")
    g = lm.generation("s")
    assert lm.compare_and_set("s", g) is True
    assert lm.compare_and_set("s", g) is False  # the second racer with the same expectation loses
    assert lm.compare_and_set("missing", 1) is False


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        LeaseConfig(idle_ttl_s=0.0, disconnect_grace_s=1.0, reaper_interval_s=1.0)
    with pytest.raises(ValueError):
        LeaseConfig(idle_ttl_s=None, disconnect_grace_s=1.0, reaper_interval_s=0.0)


async def test_reaper_runs_expiries_and_retries(clock: FakeClock) -> None:
    lm = LeaseManager(LeaseConfig(idle_ttl_s=1.0, disconnect_grace_s=1.0, reaper_interval_s=0.01), clock)
    lm.add("a")
    lm.add("b")
    expired: list[tuple[str, ExpiryReason]] = []
    retries = 0
    done = asyncio.Event()

    async def on_expire(sid: str, reason: ExpiryReason) -> None:
        if sid == "a":
            raise RuntimeError("a handler bug must not stop the reaper")
        expired.append((sid, reason))
        done.set()

    async def retry() -> None:
        nonlocal retries
        retries += 1

    reaper = Reaper(lm, on_expire, retry)
    reaper.start()
    await asyncio.sleep(0.03)
    assert expired == [] and retries >= 1
    clock.advance(1.0)
    await asyncio.wait_for(done.wait(), 1.0)
    assert expired == [("b", ExpiryReason.IDLE)]
    await reaper.aclose()


async def test_reaper_aclose_cancels_inflight_expiry(clock: FakeClock) -> None:
    lm = LeaseManager(LeaseConfig(idle_ttl_s=1.0, disconnect_grace_s=1.0, reaper_interval_s=100.0), clock)
    lm.add("a")
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def on_expire(sid: str, reason: ExpiryReason) -> None:
        started.set()
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    reaper = Reaper(lm, on_expire)
    clock.advance(1.0)
    await reaper.run_once()
    await asyncio.wait_for(started.wait(), 1.0)
    await reaper.aclose()
    assert cancelled.is_set()
