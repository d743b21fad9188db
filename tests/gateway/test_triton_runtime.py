"""`TritonRuntime` request encoding and response demultiplexing, against an in-process fake gRPC client."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from gateway.runtime.base import (
    AudioPiece,
    Decision,
    Fence,
    RuntimeFailure,
    SessionKey,
    UnitDone,
    UnitSubmission,
)
from gateway.runtime.triton import TritonRuntime
from gateway.runtime.triton_wire import build_request
from tests.gateway.triton_results import Result


class FakeClient:
    """Answers each request like the `duplex` pipeline would; records the decoded requests."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def stream_infer(self, it):  # noqa: ANN001, ANN201
        async for req in it:
            self.requests.append(req)
            rid = req["request_id"]
            name = rid.split("-")[0]
            if name == "append":
                yield Result(rid, {"type": "decision", "action": "speak", "unit": 0}), None
                yield Result(rid, {"type": "audio", "unit": 0, "seq": 0},
                             AUDIO=np.arange(480, dtype=np.int16)[None, :]), None
                yield Result(rid, {"type": "unit_done", "unit": 0, "is_listen": False, "end_of_turn": True,
                                    "metrics": {"thinker": {"tokens": 2}}}), None
            if name == "update":
                yield Result(rid, {"type": "error", "code": "invalid_runtime_config", "message": "no"}), None
            yield Result(rid, None, final=True), None

    async def is_server_live(self) -> bool:
        return True

    async def is_server_ready(self) -> bool:
        return True

    async def is_model_ready(self, name: str) -> bool:
        return name == "duplex"

    async def close(self) -> None:
        return None


def test_build_request_tensors() -> None:
    unit = UnitSubmission(0, np.zeros(16480, np.float32).tobytes(), (b"\x89PNG",), force_listen=True)
    req = build_request("duplex", 42, "append-1", "append", Fence(1, 2, 3), batch_dim=True, unit=unit)
    shapes = {i.name(): (i.shape(), i.datatype()) for i in req["inputs"]}
    assert shapes == {"OP": ([1, 1], "BYTES"), "FENCE": ([1, 3], "INT64"), "PCM": ([1, 16480], "FP32"),
                      "FRAMES": ([1, 1], "BYTES"), "FORCE_LISTEN": ([1, 1], "BOOL")}
    assert req["sequence_id"] == 42 and not req["sequence_start"] and not req["sequence_end"]
    assert req["parameters"] == {"triton_enable_empty_final_response": True}
    cancel = build_request("duplex", 42, "c", "cancel", Fence(1, 2), batch_dim=False, next_fence=Fence(1, 3))
    assert {i.name(): i.shape() for i in cancel["inputs"]} == {"OP": [1], "FENCE": [3], "NEXT_FENCE": [3]}
    assert build_request("duplex", 1, "o", "open", Fence(1, 0), batch_dim=True, config={})["sequence_start"]


async def test_operations_and_event_demux() -> None:
    client = FakeClient()
    rt = TritonRuntime("unused:1", "duplex", ("duplex",), client=client)
    key = SessionKey("s", 7)
    await rt.open(key, Fence(1, 0), {"instructions": "x"})
    events = rt.events(key)
    await rt.append(key, Fence(1, 0, 1), UnitSubmission(0, np.zeros(16480, np.float32).tobytes()))
    got = [await asyncio.wait_for(events.__anext__(), 1) for _ in range(3)]
    assert isinstance(got[0], Decision) and got[0].action == "speak"
    assert isinstance(got[1], AudioPiece) and len(got[1].pcm16) == 960
    assert isinstance(got[2], UnitDone) and got[2].end_of_turn and got[2].metrics == {"thinker": {"tokens": 2}}
    with pytest.raises(RuntimeFailure) as exc:
        await rt.update(key, Fence(1, 0), {"temperature": 9})
    assert exc.value.code == "invalid_runtime_config"
    await rt.cancel(key, Fence(1, 0), Fence(1, 1))
    await rt.close(key, Fence(1, 1))
    ops = [r["request_id"].split("-")[0] for r in client.requests]
    assert ops == ["open", "append", "update", "cancel", "close"]
    assert client.requests[0]["sequence_start"] and client.requests[-1]["sequence_end"]
    readiness = await rt.readiness()
    assert readiness.all_ready
    await rt.aclose()


class BreakingClient(FakeClient):
    """Answers `open`, then the stream breaks as when tritonserver dies."""

    async def stream_infer(self, it):  # noqa: ANN001, ANN201
        async for req in it:
            self.requests.append(req)
            yield Result(req["request_id"], None, final=True), None
            raise ConnectionError("socket closed")


async def test_events_carry_the_unit_index_the_append_submitted() -> None:
    """The pipeline numbers the units stage0 accepted (here always its unit 0); the gateway's unit 3 (units before
    it fenced off, F-4) gets its events as unit 3 (tests/gateway/test_staged_runtime.py has the staged runtime's)."""
    rt = TritonRuntime("unused:1", "duplex", ("duplex",), client=FakeClient())
    key = SessionKey("s", 7)
    await rt.open(key, Fence(1, 0), {})
    events = rt.events(key)
    await rt.append(key, Fence(1, 0, 1), UnitSubmission(3, np.zeros(16000, np.float32).tobytes()))
    got = [await asyncio.wait_for(events.__anext__(), 1) for _ in range(3)]
    assert [(type(e), e.unit) for e in got] == [(Decision, 3), (AudioPiece, 3), (UnitDone, 3)]
    await rt.aclose()


async def test_calls_on_a_broken_stream_fail_at_once_and_close_sends_nothing() -> None:
    client = BreakingClient()
    rt = TritonRuntime("unused:1", "duplex", ("duplex",), client=client)
    key = SessionKey("s", 7)
    await rt.open(key, Fence(1, 0), {})
    events = rt.events(key)
    with pytest.raises(StopAsyncIteration):  # the session learns the stream is gone
        await asyncio.wait_for(events.__anext__(), 1)
    with pytest.raises(RuntimeFailure, match="stream broke"):  # no wait for runtime_timeout_s
        await asyncio.wait_for(rt.append(key, Fence(1, 0, 1), UnitSubmission(0, b"\0" * 4)), 1)
    await asyncio.wait_for(rt.close(key, Fence(1, 0)), 1)  # nothing left to release on a dead stream
    assert [r["request_id"].split("-")[0] for r in client.requests] == ["open"]
    await rt.aclose()


class ForgetfulClient(FakeClient):
    """A close the pipeline answers with session_not_found: a stage already forgot the idle session."""

    async def stream_infer(self, it):  # noqa: ANN001, ANN201
        async for req in it:
            self.requests.append(req)
            rid = req["request_id"]
            if rid.startswith("close"):
                yield Result(rid, {"type": "error", "code": "session_not_found", "message": "gone"}), None
            yield Result(rid, None, final=True), None


async def test_close_of_a_session_the_pipeline_already_forgot_succeeds() -> None:
    rt = TritonRuntime("unused:1", "duplex", ("duplex",), client=ForgetfulClient())
    key = SessionKey("s", 7)
    await rt.open(key, Fence(1, 0), {})
    await asyncio.wait_for(rt.close(key, Fence(1, 0)), 1)
    with pytest.raises(RuntimeFailure):
        await rt.append(key, Fence(1, 0, 1), UnitSubmission(0, b"\0" * 4))
    await rt.aclose()
