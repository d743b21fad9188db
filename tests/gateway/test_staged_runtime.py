"""`StagedTritonRuntime`: the gateway chaining stage0 -> tts -> token2wav, against a fake gRPC client.

The fake answers like the three stage models; tts answers only when the test lets it, so the tests can
hold a unit in TTS while stage0 works on the next one. The real models are exercised by
tests/e2e/test_staged_serving.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from gateway.runtime.base import (
    RUNTIME_DEAD,
    AudioPiece,
    Decision,
    Fence,
    RuntimeFailure,
    SessionKey,
    StreamError,
    TextPiece,
    UnitDone,
    UnitSubmission,
)
from gateway.runtime.stages import StagedTritonRuntime, speech_config
from tests.gateway.triton_results import Result

HIDDEN_DIM = 4
KEY = SessionKey("s", 7)


class StageClient:
    """Answers like the stage models: stage0 speaks every unit whose index is even, else listens."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.tts_gate: asyncio.Event = asyncio.Event()
        self.tts_gate.set()
        self.log: list[str] = []  # "<model>:<op>:<unit> start|end", in the order the fake ran them
        self.close_error: str | None = None
        self.stage0_units = -1
        self.tts_parts = False  # answer as the TTS does at a turn's start with first_codes: a head, then the rest

    async def stream_infer(self, it):  # noqa: ANN001, ANN201
        out: asyncio.Queue[tuple[Any, Any] | None] = asyncio.Queue()

        async def feed() -> None:
            async for req in it:
                self.requests.append(req)
                asyncio.create_task(self._answer(req, out))
            out.put_nowait(None)

        feeder = asyncio.create_task(feed())
        while (item := await out.get()) is not None:
            yield item
        await feeder

    async def _answer(self, req: dict[str, Any], out: asyncio.Queue) -> None:  # noqa: C901
        rid, model = req["request_id"], req["model_name"]
        op = rid.split(":")[1].split("-")[0]
        if op == "append" and model == "stage0":
            unit = self.stage0_units = self.stage0_units + 1
            self.log.append(f"stage0:{unit} start")
            speak = unit % 2 == 0
            out.put_nowait((Result(rid, {"type": "decision", "action": "speak" if speak else "listen",
                                          "unit": unit}), None))
            if speak:
                out.put_nowait((Result(rid, {"type": "text", "text": f"t{unit}", "unit": unit}), None))
                out.put_nowait((Result(rid, {"type": "tts_input", "unit": unit, "is_turn_eos": [False],
                                              "end_of_turn": False, "turn_start": unit == 0},
                                        TOKENS=np.array([[5]], np.int64),
                                        HIDDEN=np.ones((1, HIDDEN_DIM), np.float32)), None))
            out.put_nowait((Result(rid, {"type": "unit_done", "unit": unit, "is_listen": not speak,
                                          "end_of_turn": False, "metrics": {"thinker": {"tokens": 2}}}), None))
            self.log.append(f"stage0:{unit} end")
        elif op == "append" and model == "tts":
            self.log.append("tts start")
            await self.tts_gate.wait()
            if self.tts_parts:
                out.put_nowait((Result(rid, {"type": "audio_tokens", "count": 1, "part": "head", "unit_codes": 2},
                                       TOKENS=np.array([[1]], np.int64)), None))
                out.put_nowait((Result(rid, {"type": "audio_tokens", "count": 1, "part": "rest"},
                                       TOKENS=np.array([[2]], np.int64)), None))
            else:
                out.put_nowait((Result(rid, {"type": "audio_tokens", "count": 2},
                                       TOKENS=np.array([[1, 2]], np.int64)), None))
            self.log.append("tts end")
        elif op == "append" and model == "token2wav":
            out.put_nowait((Result(rid, {"type": "audio", "unit": 0, "seq": 0},
                                    AUDIO=np.arange(480, dtype=np.int16)[None, :]), None))
        elif op == "close" and self.close_error is not None:
            out.put_nowait((Result(rid, {"type": "error", "code": self.close_error, "message": "gone"}), None))
        out.put_nowait((Result(rid, None, final=True), None))

    async def is_server_live(self) -> bool:
        return True

    async def is_server_ready(self) -> bool:
        return True

    async def is_model_ready(self, name: str) -> bool:
        return True

    async def close(self) -> None:
        return None


def _unit(index: int) -> UnitSubmission:
    return UnitSubmission(index, np.zeros(16480 if index == 0 else 16000, np.float32).tobytes())


async def _take(events: Any, n: int) -> list[Any]:
    return [await asyncio.wait_for(events.__anext__(), 2) for _ in range(n)]


async def test_a_speak_unit_flows_through_the_three_stages_in_order() -> None:
    client = StageClient()
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {"instructions": "x"})
    assert sorted(r["model_name"] for r in client.requests) == ["stage0", "token2wav", "tts"]
    assert all(r["sequence_start"] for r in client.requests)
    events = rt.events(KEY)
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    got = await _take(events, 4)
    assert [type(e) for e in got] == [Decision, TextPiece, AudioPiece, UnitDone]
    assert len(got[2].pcm16) == 960
    done = got[3]
    assert done.metrics["thinker"] == {"tokens": 2}
    assert set(done.metrics) == {"thinker", "talker", "code2wav", "unit_done"}
    talker, code2wav = done.metrics["talker"], done.metrics["code2wav"]
    # each stage from its own input (§10.1), and from the unit's append, which covers the stages before it
    assert all(m["from_unit_ms"] >= m["first_output_ms"] >= 0 for m in (talker, code2wav))
    assert code2wav["from_unit_ms"] >= talker["from_unit_ms"] + code2wav["first_output_ms"]
    # stage0's unit_done came before the TTS answered the tts_input it sent
    assert 0 <= done.metrics["unit_done"]["from_unit_ms"] <= talker["from_unit_ms"]
    tts = next(r for r in client.requests if r["request_id"].startswith("tts:append"))
    names = {i.name() for i in tts["inputs"]}
    assert {"TOKENS", "HIDDEN", "CONFIG"} <= names
    await rt.close(KEY, Fence(1, 0))
    assert sum(r["sequence_end"] for r in client.requests) == 3
    await rt.aclose()


async def test_events_carry_the_unit_index_the_append_submitted() -> None:
    """Stage0 numbers the units it accepted: after unit 1 was fenced off (F-4), the gateway's unit 2 is its unit 1.
    The session pairs decisions, text and audio by the gateway's numbers, so every event of an append carries the
    index that append submitted."""
    client = StageClient()
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {})
    events = rt.events(KEY)
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    await rt.append(KEY, Fence(1, 0, 2), _unit(2))  # stage0 counts it as its unit 1 (and listens)
    got = await _take(events, 6)  # (unit 2's decision may go out before unit 0's audio: P13)
    assert sorted((e.unit, type(e).__name__) for e in got) == [
        (0, "AudioPiece"), (0, "Decision"), (0, "TextPiece"), (0, "UnitDone"), (2, "Decision"), (2, "UnitDone")]
    await rt.aclose()


def _config(req: dict[str, Any]) -> dict[str, Any]:
    """A request's CONFIG, as build_request serialised it (one BYTES element: 4-byte length, then JSON)."""
    raw = next(i for i in req["inputs"] if i.name() == "CONFIG")._raw_content
    return json.loads(raw[4:])


@pytest.mark.parametrize("end_of_turn", [False, True])
async def test_a_unit_the_tts_sends_in_two_parts_reaches_token2wav_as_two_appends(end_of_turn: bool) -> None:
    """A turn's first codes sent early (TTS `first_codes`): each part goes on to token2wav as it comes, with its part
    and the whole unit's code count; only the rest may end the turn."""
    client = StageClient()
    client.tts_parts = True
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {"instructions": "x"})
    events = rt.events(KEY)
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    got = await _take(events, 5)
    assert [type(e) for e in got] == [Decision, TextPiece, AudioPiece, AudioPiece, UnitDone]
    calls = [r for r in client.requests if r["request_id"].startswith("token2wav:append")]
    assert [_config(r) for r in calls] == [{"unit": 0, "end_of_turn": False, "part": "head", "unit_codes": 2},
                                           {"unit": 0, "end_of_turn": False, "part": "rest"}]
    assert speech_config(4, {"end_of_turn": end_of_turn}, {"part": "head", "unit_codes": 24})["end_of_turn"] is False
    assert speech_config(4, {"end_of_turn": end_of_turn}, {"part": "rest"}) == {
        "unit": 4, "end_of_turn": end_of_turn, "part": "rest"}
    assert speech_config(4, {"end_of_turn": end_of_turn}, {"count": 3}) == {"unit": 4, "end_of_turn": end_of_turn}
    await rt.close(KEY, Fence(1, 0))
    await rt.aclose()


async def test_stage0_runs_the_next_unit_while_tts_holds_the_previous_one_and_output_keeps_unit_order() -> None:
    client = StageClient()
    client.tts_gate.clear()
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {})
    events = rt.events(KEY)
    await asyncio.wait_for(rt.append(KEY, Fence(1, 0, 1), _unit(0)), 2)  # acked with its TTS still running
    first = await _take(events, 2)  # unit 0's decision and text go out at once
    assert [type(e) for e in first] == [Decision, TextPiece]
    seen: list[Any] = []
    collector = asyncio.create_task(_collect(events, seen))
    await asyncio.wait_for(rt.append(KEY, Fence(1, 0, 2), _unit(1)), 2)
    assert "stage0:1 end" in client.log and "tts end" not in client.log  # stage0 ran unit 1 during unit 0's TTS
    await asyncio.sleep(0.2)
    # unit 0 left stage0 speaking without ending the turn: unit 1's decision goes out ahead of unit 0's audio
    # (P13); its UnitDone waits for unit 0's
    assert [(type(e), e.unit) for e in seen] == [(Decision, 1)]
    client.tts_gate.set()
    await asyncio.sleep(0.2)
    assert [(type(e), e.unit) for e in seen] == [(Decision, 1), (AudioPiece, 0), (UnitDone, 0), (UnitDone, 1)]
    collector.cancel()
    await rt.aclose()


async def _collect(events: Any, into: list[Any]) -> None:
    async for ev in events:
        into.append(ev)


async def test_cancel_reaches_every_stage_and_drops_the_old_epochs_units() -> None:
    client = StageClient()
    client.tts_gate.clear()
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {})
    events = rt.events(KEY)
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    await _take(events, 2)
    await asyncio.wait_for(rt.cancel(KEY, Fence(1, 0), Fence(1, 1)), 2)  # not held back by the unit in TTS
    cancels = [r["model_name"] for r in client.requests if r["request_id"].split(":")[1].startswith("cancel")]
    assert sorted(cancels) == ["stage0", "token2wav", "tts"]
    await rt.append(KEY, Fence(1, 1, 2), _unit(1))  # the new epoch's unit is not held behind the old one
    (ev,) = await _take(events, 1)
    assert isinstance(ev, Decision) and ev.epoch == 1 and ev.unit == 1
    client.tts_gate.set()
    await rt.aclose()


async def test_a_failed_tts_call_reaches_the_session_as_a_stream_error() -> None:
    class FailingTTS(StageClient):
        async def _answer(self, req: dict[str, Any], out: asyncio.Queue) -> None:
            if req["model_name"] == "tts" and "append" in req["request_id"]:
                rid = req["request_id"]
                out.put_nowait((Result(rid, {"type": "error", "code": "invalid_request", "message": "rows"}), None))
                out.put_nowait((Result(rid, None, final=True), None))
                return
            await super()._answer(req, out)

    rt = StagedTritonRuntime("unused:1", client=FailingTTS())
    await rt.open(KEY, Fence(1, 0), {})
    events = rt.events(KEY)
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    got = await _take(events, 4)
    assert [type(e) for e in got] == [Decision, TextPiece, StreamError, UnitDone]
    assert got[2].code == "invalid_request"
    await rt.aclose()


async def test_close_of_a_session_a_stage_already_forgot_succeeds() -> None:
    client = StageClient()
    client.close_error = "session_not_found"
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {})
    await rt.close(KEY, Fence(1, 0))
    with pytest.raises(RuntimeFailure):
        await rt.append(KEY, Fence(1, 0, 1), _unit(0))  # the session is gone from the runtime
    await rt.aclose()


async def test_a_stream_error_from_triton_ends_the_session_and_close_still_succeeds() -> None:
    class Expired(StageClient):
        async def stream_infer(self, it):  # noqa: ANN001, ANN201
            async for req in it:
                self.requests.append(req)
                if req["request_id"].split(":")[1].startswith("append"):
                    yield None, RuntimeError("inference request for sequence 7 to model 'stage0' must specify "
                                             "the START flag on the first request of the sequence")
                    return
                yield Result(req["request_id"], None, final=True), None

    rt = StagedTritonRuntime("unused:1", client=Expired())
    await rt.open(KEY, Fence(1, 0), {})
    events = rt.events(KEY)
    with pytest.raises(RuntimeFailure) as exc:
        await asyncio.wait_for(rt.append(KEY, Fence(1, 0, 1), _unit(0)), 2)
    assert exc.value.code == RUNTIME_DEAD and "START flag" in exc.value.message  # the session is gone with it
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(events.__anext__(), 1)
    await asyncio.wait_for(rt.close(KEY, Fence(1, 0)), 1)
    await rt.aclose()


async def test_an_open_refused_by_one_stage_closes_the_stages_that_opened() -> None:
    class FullTTS(StageClient):
        async def _answer(self, req: dict[str, Any], out: asyncio.Queue) -> None:
            rid = req["request_id"]
            if rid.startswith("tts:open"):
                out.put_nowait((Result(rid, {"type": "error", "code": "runtime_backpressure", "message": "full"}),
                                None))
                out.put_nowait((Result(rid, None, final=True), None))
                return
            await super()._answer(req, out)

    client = FullTTS()
    rt = StagedTritonRuntime("unused:1", client=client)
    with pytest.raises(RuntimeFailure) as exc:
        await rt.open(KEY, Fence(1, 0), {})
    assert exc.value.code == "runtime_backpressure"
    closed = sorted(r["model_name"] for r in client.requests if r["sequence_end"])
    assert closed == ["stage0", "token2wav"]
    with pytest.raises(RuntimeFailure):
        await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    await rt.aclose()


class Killable(StageClient):
    """A StageClient whose gRPC stream can break as when tritonserver is killed (UNAVAILABLE); stage0 answers
    no unit from `stage0_hold_from` on, so an append is in flight when it breaks; a stage answers its close only
    after the appends sent to it before (a Triton sequence's order), tts's therefore after the tts gate."""

    KILL = object()

    def __init__(self, stage0_hold_from: int = 1 << 30) -> None:
        super().__init__()
        self.stage0_hold_from = stage0_hold_from
        self.out: asyncio.Queue[Any] = asyncio.Queue()

    async def stream_infer(self, it):  # noqa: ANN001, ANN201
        async def feed() -> None:
            async for req in it:
                self.requests.append(req)
                asyncio.create_task(self._answer(req, self.out))

        feeder = asyncio.create_task(feed())
        try:
            while (item := await self.out.get()) is not None:
                if item is self.KILL:
                    raise RuntimeError("StatusCode.UNAVAILABLE: Stream removed (recvmsg:Connection reset by peer)")
                yield item
        finally:
            feeder.cancel()

    async def _answer(self, req: dict[str, Any], out: asyncio.Queue) -> None:
        rid = req["request_id"]
        if rid.startswith("stage0:append") and self.stage0_units + 1 >= self.stage0_hold_from:
            await asyncio.Event().wait()  # the unit is still running when Triton dies
        if rid.startswith("tts:close"):
            await self.tts_gate.wait()
        await super()._answer(req, out)

    def kill(self) -> None:
        self.out.put_nowait(self.KILL)


async def test_a_triton_kill_ends_the_events_with_no_stream_error_per_call_in_flight() -> None:
    client = Killable(stage0_hold_from=1)
    client.tts_gate.clear()  # unit 0's tts call is in flight when Triton dies
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {})
    events = rt.events(KEY)
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    assert [type(e) for e in await _take(events, 2)] == [Decision, TextPiece]
    in_flight = asyncio.create_task(rt.append(KEY, Fence(1, 0, 2), _unit(1)))
    await asyncio.sleep(0.05)
    client.kill()
    rest = [ev async for ev in events]  # the events end: the session reports that once, as runtime_dead
    assert rest == []  # no StreamError for unit 0's tts call that the break failed
    with pytest.raises(RuntimeFailure) as exc:
        await asyncio.wait_for(in_flight, 2)
    assert exc.value.code == RUNTIME_DEAD and "UNAVAILABLE" in exc.value.message
    with pytest.raises(RuntimeFailure) as exc:
        await rt.append(KEY, Fence(1, 0, 3), _unit(2))
    assert exc.value.code == RUNTIME_DEAD
    await asyncio.wait_for(rt.close(KEY, Fence(1, 0)), 1)  # nothing to close on a dead stream: done
    await rt.aclose()


async def test_no_stage_call_starts_once_the_close_went_out() -> None:
    client = Killable()
    client.tts_gate.clear()  # unit 0 waits in tts; tts answers the close after it
    rt = StagedTritonRuntime("unused:1", client=client)
    await rt.open(KEY, Fence(1, 0), {})
    await rt.append(KEY, Fence(1, 0, 1), _unit(0))
    closing = asyncio.create_task(rt.close(KEY, Fence(1, 0)))
    await asyncio.sleep(0.05)
    client.tts_gate.set()  # tts now sends unit 0's audio tokens, then answers the close
    await asyncio.wait_for(closing, 2)
    sent = [r["request_id"].split("-")[0] for r in client.requests]
    # Triton refuses a request after a sequence's end (no START flag): the stream would break under the close
    assert "token2wav:append" not in sent[sent.index("token2wav:close"):]
    assert "token2wav:append" not in sent  # tts's tokens came after the close: nobody would hear them
    await rt.aclose()


def test_unit_order_sends_a_units_decision_and_text_early_only_inside_one_spoken_turn() -> None:
    from gateway.runtime.stages import UnitOrder, _Unit

    out: list[Any] = []
    order = UnitOrder(out.append)
    u0, u1, u2 = _Unit(0, 0), _Unit(1, 0), _Unit(2, 0)
    for u in (u0, u1, u2):
        order.add(u)
    order.emit(u0, Decision(epoch=0, unit=0, action="speak"))
    order.emit(u1, Decision(epoch=0, unit=1, action="speak"))  # unit 0 is still in stage0: held
    assert [e.unit for e in out] == [0]
    u0.done_event = UnitDone(epoch=0, unit=0, is_listen=False, end_of_turn=False)
    order.settle()  # unit 0 left stage0 speaking, the turn goes on: unit 1's held decision goes out
    order.emit(u1, TextPiece(epoch=0, unit=1, text="a"))
    assert [(type(e), e.unit) for e in out] == [(Decision, 0), (Decision, 1), (TextPiece, 1)]
    order.emit(u1, AudioPiece(epoch=0, unit=1, seq=0, pcm16=b"\0\0"))  # audio keeps its unit order: held
    u1.done_event = UnitDone(epoch=0, unit=1, is_listen=False, end_of_turn=True)
    order.emit(u2, Decision(epoch=0, unit=2, action="speak"))  # behind the turn's end: a new response, held
    order.settle()
    assert len(out) == 3
    u0.stage0_open = False
    order.settle()  # unit 0 done: its UnitDone, then unit 1's audio
    assert [(type(e), e.unit) for e in out[3:]] == [(UnitDone, 0), (AudioPiece, 1)]
    u1.stage0_open = False
    order.settle()
    assert [(type(e), e.unit) for e in out[5:]] == [(UnitDone, 1), (Decision, 2)]
