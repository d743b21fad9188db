"""A close after audio sent far faster than real time, through the real tritonserver + gateway (issue 18).

bench/soak.py found `runtime_close_failed` / `cleanup_pending:true` on such closes: the cleanup ran the whole
backlog through stage0 (about 1 s a unit on this CPU) and outlasted `close_ack_timeout_s`. The close now drops
the input not yet sent to Triton and waits only for the unit in flight (protocol.md §3.10 X4).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.e2e.stack import OPS_ENV
from tests.e2e.wire import WAIT_S, collect_until, fit_units, send_audio
from tests.gateway_ops.test_wired_admission import admits
from tests.gateway_ops.wire import eventually, opened

pytestmark = pytest.mark.e2e

STACK_ENV = OPS_ENV  # the stack test_ops shares: close_ack_timeout_s 5, a pending-input limit above the backlog
CLOSE_ACK_TIMEOUT_S = float(STACK_ENV["DUPLEX_CLOSE_ACK_TIMEOUT_S"])  # the backlog takes stage0 several times this
BACKLOG_UNITS = 40  # 40 s of audio sent at once
assert BACKLOG_UNITS * 16000 * 2 < int(STACK_ENV["DUPLEX_MAX_PENDING_INPUT_BYTES_PER_SESSION"])


async def test_a_close_behind_a_backlog_of_input_is_clean_and_frees_the_slot(addr: str) -> None:
    c, _ = await opened(addr)
    noise = np.random.default_rng(0).normal(0, 0.05, 16000 * BACKLOG_UNITS).astype(np.float32)
    await send_audio(c, fit_units(noise, BACKLOG_UNITS), pace=0)
    await collect_until(c, lambda e: e["type"] in ("response.listen", "response.created"), WAIT_S)  # stage0 is busy
    t0 = time.monotonic()
    await c.send({"type": "session.close"})
    closed = await c.until("session.closed", WAIT_S)
    took = time.monotonic() - t0
    errors = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert errors == [] and closed["cleanup_pending"] is False, (errors, closed)
    assert took < CLOSE_ACK_TIMEOUT_S
    await c.ws.close()
    await eventually(lambda: admits(addr), WAIT_S)  # and the slot is free
