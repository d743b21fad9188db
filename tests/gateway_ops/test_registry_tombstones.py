"""Tombstones keep a closed session id's incarnation for their TTL (§4.1), and no longer than that: the registry
must not grow by one entry per session ever closed (issue 18, nothing leaks)."""

from __future__ import annotations

from gateway.registry import SessionRegistry
from tests.gateway_ops.conftest import FakeClock


def test_tombstones_expire_and_do_not_accumulate(clock: FakeClock) -> None:
    reg = SessionRegistry(tombstone_ttl_s=60.0, clock=clock)
    assert reg.reserve("a") == 1
    reg.release("a")
    assert reg.reserve("a") == 2  # within the TTL: the next incarnation
    reg.release("a")
    for i in range(1000):  # a busy server: a thousand sessions over ~17 minutes
        reg.reserve(f"s{i}")
        reg.release(f"s{i}")
        clock.advance(1.0)
    assert len(reg._tombstones) <= 61  # only the last TTL's worth is kept
    assert reg.reserve("a") == 1  # long expired: a fresh incarnation
