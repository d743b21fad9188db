"""Killing tritonserver mid-session (issue 7): typed errors, the gateway stays up, /ready red, service again after
Triton is restarted.

This module runs the two halves as separate launchers, `duplex serve --only triton` and `duplex serve --only
gateway --triton-url ...` (the two containers of docker-compose.yml), and kills/restarts only the Triton one:
`--only triton` exits when its Triton dies (its container's restart policy is the supervisor). A plain
`duplex serve` restarts Triton itself under the running gateway: tests/e2e/test_launcher.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.stack import Stack
from tests.e2e.wire import WAIT_S, collect_until, fit_units, send_audio, silence
from tests.gateway_ops.test_wired_admission import admits, refusal
from tests.gateway_ops.wire import eventually, http_get, metric, opened

pytestmark = pytest.mark.e2e

STACK_MODE = "split"
CLOSE_WAIT_S = 20.0  # runtime_timeout_s (10 s) + margin, so a slow close shows as a failure below
READY_WAIT_S = 30.0
PROMPT_CLOSE_S = 3.0  # kill -> session.closed, including ~0.5 s for the triton launcher to notice and exit
OBSERVED: dict = {}  # the kill test's recorded stream, checked by the xfail test below
STACK_ENV = {"DUPLEX_READY_CACHE_S": "0", "DUPLEX_CLEANUP_RETRY_BASE_S": "0.1", "DUPLEX_FORCE_LISTEN_COUNT": "0"}


async def _one_unit_decided(addr: str) -> None:
    c, _ = await opened(addr)
    await send_audio(c, fit_units(silence(0), 1), pace=0)
    await collect_until(c, lambda e: e["type"] in ("response.listen", "response.created"), WAIT_S)
    await c.send({"type": "session.close"})
    await c.until("session.closed", WAIT_S)
    await c.ws.close()


async def _kill_and_watch(stack: Stack) -> tuple[list[dict], float]:
    """Open a session, SIGKILL tritonserver; returns the events up to the close and the seconds it took."""
    c, _ = await opened(stack.addr)
    t0 = time.monotonic()
    OBSERVED["launcher_exit"] = await asyncio.to_thread(stack.kill_triton)
    err = await c.until("error", CLOSE_WAIT_S)
    assert err["error"]["code"] == "runtime_dead" and err["error"]["type"] == "server_error"
    assert err["error"]["retryable"] is True
    closed = await c.until("session.closed", CLOSE_WAIT_S)
    took = time.monotonic() - t0
    assert closed["reason"] == "runtime_failure"
    assert (await c.closed())[0] == 1000
    return c.events, took


async def _restart(stack: Stack) -> None:
    await asyncio.to_thread(stack.restart_triton)
    await eventually(lambda: _ready(stack.addr), READY_WAIT_S)
    await eventually(lambda: admits(stack.addr), READY_WAIT_S)  # the dead session's slot is freed


async def _ready(addr: str) -> bool:
    return (await http_get(addr, "/ready")).status_code == 200


async def test_triton_killed_mid_session_then_restarted(stack: Stack) -> None:
    addr = stack.addr
    await _one_unit_decided(addr)  # the stack serves before the crash
    gateway_pid = stack.procs["gateway"].popen.pid
    events, took = await _kill_and_watch(stack)
    OBSERVED.update(events=events, took=took)
    assert (await http_get(addr, "/health")).status_code == 200  # the gateway stays up
    ready = await http_get(addr, "/ready")
    assert ready.status_code == 503 and ready.json()["checks"]["triton_live"] is False
    assert await refusal(addr) == ("runtime_unavailable", 1013, "runtime_unavailable")
    await _restart(stack)
    assert stack.procs["gateway"].alive() and stack.procs["gateway"].popen.pid == gateway_pid
    assert OBSERVED["launcher_exit"] == 1  # `duplex serve --only triton` exits on Triton's death (no restart)
    text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_runtime_errors_total", code="runtime_dead") >= 1
    assert metric(text, "duplex_admission_rejected_total", code="runtime_unavailable") >= 1
    await _one_unit_decided(addr)  # a real unit through the restarted Triton


def test_runtime_death_closes_the_session_promptly() -> None:
    """Checks the stream recorded by the kill above (one kill/restart per module keeps the suite short)."""
    if "events" not in OBSERVED:
        pytest.skip("the kill/restart test did not get as far as the session close")
    events, took = OBSERVED["events"], OBSERVED["took"]
    codes = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert codes == ["runtime_dead"], codes
    assert took < PROMPT_CLOSE_S, f"session.closed {took:.1f}s after the kill"
