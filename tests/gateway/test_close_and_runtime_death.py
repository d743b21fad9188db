"""What a client sees when it closes with a backlog of input, and when Triton dies under a response (issue 18).

Found by bench/soak.py: a close after audio sent faster than real time waited for the backlog to run through
the model and outlasted `close_ack_timeout_s` (`runtime_close_failed`, `cleanup_pending:true`); a Triton kill
showed `runtime_stream_failed` / `runtime_append_failed` for each call in flight before `runtime_dead`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from gateway.runtime.base import RUNTIME_DEAD, Fence, RuntimeFailure, SessionKey, UnitSubmission
from gateway.runtime.stages import StagedTritonRuntime
from gateway.runtime.triton import TritonRuntime
from gateway.session.lane import AppendAcked, RuntimeLane
from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.scenario import session, stream_units
from tests.gateway.test_staged_runtime import Killable
from tests.gateway.test_triton_runtime import BreakingClient

BACKLOG_UNITS = 8
UNIT_DELAY_S = 0.3  # the model's time per unit: the backlog would take 2.4 s, the close may take 1 s
CLOSE_ACK_TIMEOUT_S = 1.0


async def test_a_close_behind_a_backlog_of_input_frees_the_slot_at_once() -> None:
    rt = FakeRuntime()
    rt.append_delay_s = UNIT_DELAY_S
    async with session(rt, close_ack_timeout_s=CLOSE_ACK_TIMEOUT_S) as (c, _):
        await stream_units(c, BACKLOG_UNITS)  # as fast as the socket takes it: far ahead of the model
        await c.send({"type": "session.close"})
        got = await c.until("session.closed")
    assert [e["error"]["code"] for e in got if e["type"] == "error"] == []
    assert got[-1]["cleanup_pending"] is False
    appends = [op for op, _ in rt.ops if op == "append"]
    assert 0 < len(appends) < BACKLOG_UNITS  # the input still queued at the close never ran
    assert rt.ops[-1][0] == "close"


async def test_a_triton_kill_under_a_response_is_one_runtime_dead() -> None:
    client = Killable(stage0_hold_from=2)  # unit 0 speaks, unit 1 listens, unit 2 is running at the kill
    client.tts_gate.clear()  # unit 0's speech is in tts at the kill
    rt = StagedTritonRuntime("unused:1", client=client)
    async with session(rt) as (c, _):  # type: ignore[arg-type]
        await stream_units(c, 3)
        await c.until("response.created")
        while client.stage0_units < 1:  # noqa: ASYNC110 - the fake's progress has no event to wait on
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        client.kill()
        got = await c.until("session.closed")
    errors = [e["error"]["code"] for e in got if e["type"] == "error"]
    assert errors == ["runtime_dead"]
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "failed" and done["duplex"]["reason"] == "runtime_dead"
    assert got[-1]["reason"] == "runtime_failure"


async def test_the_pipeline_runtime_fails_work_on_a_broken_stream_as_runtime_dead() -> None:
    rt = TritonRuntime("unused:1", "duplex", ("duplex",), client=BreakingClient())
    key = SessionKey("s", 7)
    await rt.open(key, Fence(1, 0), {})
    with pytest.raises(RuntimeFailure) as exc:  # the session does not report it: the events' end says it once
        await asyncio.wait_for(rt.append(key, Fence(1, 0, 1), _unit(0)), 1)
    assert exc.value.code == RUNTIME_DEAD
    await rt.aclose()


class _Runtime:
    """Appends and cancels that wait until the test lets them finish."""

    def __init__(self) -> None:
        self.append_gate, self.cancel_gate = asyncio.Event(), asyncio.Event()
        self.appended: list[int] = []

    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        await self.append_gate.wait()
        self.appended.append(unit.unit_index)

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        await self.cancel_gate.wait()


def _unit(index: int) -> UnitSubmission:
    return UnitSubmission(index, np.zeros(16000, np.float32).tobytes())


async def test_a_queue_dropped_while_a_cancel_is_in_flight_leaves_the_lane_drainable() -> None:
    rt = _Runtime()
    posted: list[Any] = []
    lane = RuntimeLane(rt, SessionKey("s", 1), lambda: Fence(1, 0), posted.append,  # type: ignore[arg-type]
                       max_pending_bytes=1 << 20, timeout_s=5)
    lane.start()
    lane.submit(_unit(0), 10)
    await asyncio.sleep(0.01)  # unit 0 in flight
    lane.cancel(Fence(1, 0), Fence(1, 1))
    lane.submit(_unit(1), 10)
    rt.append_gate.set()
    await asyncio.sleep(0.01)  # unit 0 acked; the lane now waits for the cancel before unit 1
    lane.drop_queued()  # input.cancel, or the close
    rt.cancel_gate.set()
    await asyncio.wait_for(lane.drain(), 1)  # the lane used to die on an empty queue here: drain never returned
    lane.submit(_unit(2), 10)  # and it still runs what comes next
    await asyncio.wait_for(lane.drain(), 1)
    assert rt.appended == [0, 2]
    assert [type(r) for r in posted] == [AppendAcked, AppendAcked]
    await lane.aclose()
