"""Admission (§5.2) and Triton failure (issue 7) through the real gateway over real WebSockets.

The scenario functions take an address (and, for the failure one, kill/restore callables), so the real-Triton
e2e run can call them against a running gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.runtime.base import Fence, RuntimeFailure, SessionKey
from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.harness import serve
from tests.gateway_ops.wire import eventually, http_get, metric, opened, raw


class KillableRuntime(FakeRuntime):
    """The fake Triton that can die: streams end, opens/closes fail, readiness goes red."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False

    def kill(self) -> None:
        self.dead, self.ready = True, False
        for seq in self.seqs.values():
            seq.queue.put_nowait(None)

    def restore(self) -> None:
        self.dead, self.ready = False, True

    async def open(self, key: SessionKey, fence: Fence, config) -> None:  # noqa: ANN001
        if self.dead:
            raise RuntimeFailure("unavailable", "runtime is down")
        await super().open(key, fence, config)

    async def close(self, key: SessionKey, fence: Fence) -> None:
        self.ops.append(("close_attempt", fence))
        if self.dead:
            raise RuntimeFailure("unavailable", "runtime is down")
        await super().close(key, fence)


async def refusal(addr: str) -> tuple[str, int, str]:
    async with raw(addr) as c:
        ev = await c.recv()
        if ev["type"] == "session.created":
            await c.send({"type": "session.close"})
            await c.closed()
            return "admitted", 0, ""
        code, reason = await c.closed()
        return ev["error"]["code"], code, reason


async def admits(addr: str) -> bool:
    return (await refusal(addr))[0] == "admitted"


async def scenario_capacity(addr: str, limit: int) -> None:
    """The (N+1)th session is refused; admitted after one closes (AD-1, AD-2, AD-4)."""
    held = [await opened(addr) for _ in range(limit)]
    caps = (await http_get(addr, "/v1/duplex/capabilities")).json()
    assert caps["active_sessions"] == limit and caps["limits"]["max_sessions"] == limit
    async with raw(addr) as extra:
        err = await extra.recv()
        assert err["error"]["code"] == "resource_exhausted" and err["error"]["retryable"] is True
        assert err["error"]["message"] == f"duplex_session_capacity_exhausted: limit={limit}"
        assert await extra.closed() == (1013, "resource_exhausted")
    first, _ = held[0]
    await first.send({"type": "session.close"})
    closed = await first.until("session.closed")
    assert closed["cleanup_pending"] is False
    assert await admits(addr)  # the slot was freed before session.closed was sent
    for c, _ in held[1:]:
        await c.ws.close()
    text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_admission_rejected_total", code="resource_exhausted") >= 1


async def test_n_plus_one_refused_then_admitted() -> None:
    async with serve(FakeRuntime(), max_sessions=2) as addr:
        await scenario_capacity(addr, 2)


async def test_closing_session_keeps_its_slot_until_cleanup_succeeds() -> None:
    rt = FakeRuntime()
    async with serve(rt, max_sessions=1, cleanup_retry_base_s=0.2) as addr:
        c, _ = await opened(addr)
        # Runtime closes fail until the refusal is seen (AD-3). A close that failed only once raced the refusal: on a
        # loaded machine the reaper's retry, 0.1 s later, could free the slot first (one CI run did).
        rt.failing["close"] = "unavailable"
        await c.send({"type": "session.close"})
        closed = await c.until("session.closed")
        assert closed["cleanup_pending"] is True
        await c.ws.close()
        assert (await refusal(addr))[:2] == ("resource_exhausted", 1013)  # still closing: slot held
        del rt.failing["close"]
        await eventually(lambda: admits(addr))  # the reaper retried the cleanup and freed the slot
    assert sum(op == "close" for op, _ in rt.ops) >= 2


async def scenario_runtime_failure(addr: str, kill: Callable[[], Awaitable[None]],
                                   restore: Callable[[], Awaitable[None]]) -> None:
    """Triton dies mid-session: typed error, clean close, refusals while /ready is red, then service again."""
    c, _ = await opened(addr)
    await kill()
    err = await c.until("error")
    assert err["error"]["code"] == "runtime_dead" and err["error"]["type"] == "server_error"
    closed = await c.until("session.closed")
    assert closed["reason"] == "runtime_failure"
    assert (await c.closed())[0] == 1000
    assert (await http_get(addr, "/health")).status_code == 200  # the gateway stays up
    assert (await http_get(addr, "/ready")).status_code == 503
    assert await refusal(addr) == ("runtime_unavailable", 1013, "runtime_unavailable")
    await restore()
    await eventually(lambda: _ready(addr))
    await eventually(lambda: admits(addr))  # the dead session's slot is freed once cleanup succeeds
    text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_runtime_errors_total", code="runtime_dead") >= 1
    assert metric(text, "duplex_admission_rejected_total", code="runtime_unavailable") >= 1


async def _ready(addr: str) -> bool:
    return (await http_get(addr, "/ready")).status_code == 200


async def test_runtime_death_types_errors_refuses_and_recovers() -> None:
    rt = KillableRuntime()

    async def kill() -> None:
        rt.kill()

    async def restore() -> None:
        rt.restore()

    async with serve(rt, max_sessions=1, ready_cache_s=0.0, cleanup_retry_base_s=0.05) as addr:
        await scenario_runtime_failure(addr, kill, restore)
    assert sum(op == "close_attempt" for op, _ in rt.ops) >= 2  # failed while dead, retried after restore



class HungRuntime(FakeRuntime):
    """Triton that accepts connections but never answers (a hung process, a black-holed network)."""

    async def readiness(self):  # noqa: ANN201
        await asyncio.Event().wait()


async def test_hung_runtime_probe_does_not_hang_ready_or_the_handshake() -> None:
    async with serve(HungRuntime(), ready_probe_timeout_s=0.2, ready_cache_s=0.0) as addr:
        async with asyncio.timeout(2):
            ready = await http_get(addr, "/ready")
            assert ready.status_code == 503 and "runtime probe failed: TimeoutError" in ready.json()["reasons"]
            assert await refusal(addr) == ("runtime_unavailable", 1013, "runtime_unavailable")
