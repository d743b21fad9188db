"""`StagedTritonRuntime`: the `Runtime` protocol with the gateway chaining the stage models itself.

One gRPC stream per session carries requests to all three stage models (a Triton streaming RPC is not
tied to one model; each model's sequence batcher keys the session by the same CORRELATION_ID). Stage0
streams its decisions and text as it generates them; its `tts_input` starts a `tts` request at once and
each `audio_tokens` a `token2wav` request, so TTS and Token2Wav of unit N run while stage0 works on unit
N+1 of the same session, and every stage engine batches across all sessions with work. An append is
acknowledged when stage0 has finished its unit (A-1: the next append waits for that, not for the audio).
A cancel goes to the three stages at once. Why this and not the `duplex` BLS model: docs/triton.md.

Per session the units leave in order (`UnitOrder`): unit N's events are held until unit N-1's `UnitDone`
has gone out, and a unit's `UnitDone` follows its audio, which is what the session's projection expects
(one response per model turn; a unit's audio leaves per Token2Wav call, its end with the UnitDone). One
exception: once stage0 has finished unit N-1 speaking and without ending the turn, unit N belongs to the same
response, so its decision and text go out as stage0 makes them, ahead of unit N-1's audio (P13).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.runtime.base import (
    RUNTIME_DEAD,
    Decision,
    Fence,
    Readiness,
    RuntimeEvent,
    RuntimeFailure,
    SessionKey,
    StreamError,
    TextPiece,
    UnitDone,
    UnitSubmission,
)
from gateway.runtime.grpc_client import probe_readiness
from gateway.runtime.triton_wire import STAGE_OUTPUTS, as_unit, build_request, typed_event

STAGE0, TTS, TOKEN2WAV = "stage0", "tts", "token2wav"
STAGES = (STAGE0, TTS, TOKEN2WAV)
TURN_KEYS = ("is_turn_eos", "end_of_turn", "turn_start")  # the tts_input fields the tts stage needs
PART_KEYS = ("part", "unit_codes")  # an audio_tokens event's unit part (a turn's first codes sent early) for token2wav
MS_PER_S = 1000.0

OnEvent = Callable[[dict[str, Any], Any], None]  # (event, result) for each response carrying an EVENT
OnFinal = Callable[[RuntimeFailure | None], None]  # the request's end: None, or why it failed


@dataclass
class _Call:
    on_event: OnEvent
    on_final: OnFinal
    failure: RuntimeFailure | None = None  # the first `error` EVENT of this request


class _Stream:
    """One session's gRPC stream: requests to any stage model, responses routed back by request id."""

    def __init__(self, client: Any, key: SessionKey, batch_dim: bool, on_broken: Callable[[RuntimeFailure], None]
                 ) -> None:
        self.client, self.key, self.batch_dim, self._on_broken = client, key, batch_dim, on_broken
        self.requests: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.calls: dict[str, _Call] = {}
        self._ids = itertools.count(1)
        self.broken: RuntimeFailure | None = None
        self.reader = asyncio.create_task(self._read(), name=f"triton-stages:{key.session_id}")

    def send(self, model: str, op: str, fence: Fence, on_event: OnEvent, on_final: OnFinal, **kw: Any) -> None:
        if self.broken is not None:
            raise self.broken
        rid = f"{model}:{op}-{next(self._ids)}"
        self.calls[rid] = _Call(on_event, on_final)
        self.requests.put_nowait(build_request(model, self.key.correlation_id, rid, op, fence,
                                               batch_dim=self.batch_dim, outputs=STAGE_OUTPUTS, **kw))

    async def call(self, model: str, op: str, fence: Fence, on_event: OnEvent | None = None, **kw: Any) -> None:
        """Send and wait for the final response; an `error` EVENT raises it as a RuntimeFailure."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def final(failure: RuntimeFailure | None) -> None:
            if not fut.done():
                fut.set_exception(failure) if failure is not None else fut.set_result(None)

        self.send(model, op, fence, on_event or _ignore, final, **kw)
        await fut

    async def _iter(self) -> AsyncIterator[dict[str, Any]]:
        while (req := await self.requests.get()) is not None:
            yield req

    async def _read(self) -> None:
        try:
            async for result, error in self.client.stream_infer(self._iter()):
                if error is not None:
                    # tritonclient gives no request id with a stream error, so no single call can be failed; the
                    # ones seen here mean the sequence is gone (idle expiry, server restart): end the session.
                    self._break(triton_failure(str(error)))
                    return
                self._on_result(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream is gone: every waiter and the session learn it
            self._break(RuntimeFailure(RUNTIME_DEAD, f"stream broke: {exc}"))  # e.g. UNAVAILABLE: Triton died
        finally:
            self._break(RuntimeFailure(RUNTIME_DEAD, "stream ended"))

    def _on_result(self, result: Any) -> None:
        resp = result.get_response()
        call = self.calls.get(resp.id)
        if call is None:
            return
        raw = result.as_numpy("EVENT")
        if raw is not None and raw.size:
            ev = json.loads(raw.reshape(-1)[0])
            if ev.get("type") == "error":
                call.failure = call.failure or RuntimeFailure(ev.get("code", "internal_error"), ev.get("message", ""))
            else:
                call.on_event(ev, result)
        final = resp.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            del self.calls[resp.id]
            call.on_final(call.failure)

    def _break(self, cause: RuntimeFailure) -> None:
        if self.broken is not None:
            return
        # the session's runtime binding is gone with its stream: every waiter fails as the session does
        failure = cause if cause.code == RUNTIME_DEAD else RuntimeFailure(RUNTIME_DEAD, f"{cause.code}: {cause.message}")
        self.broken = failure
        self._on_broken(failure)  # first: the session's output ends here, nothing a failed call settles goes out
        calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            call.on_final(failure)

    async def aclose(self) -> None:
        self.requests.put_nowait(None)
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reader


def triton_failure(message: str) -> RuntimeFailure:
    """A stream error from Triton itself (docs/triton.md "Errors") as a runtime failure."""
    if "START flag" in message:
        return RuntimeFailure("session_not_found", message)  # the sequence is unknown to Triton
    return RuntimeFailure("internal_error", message)


def _reportable(failure: RuntimeFailure, s: _Session) -> bool:
    """Whether a failed tts / token2wav call is the session's news. Not when a cancel overtook the unit
    (stale), the session is closing, or the stream broke: its end reaches the session as `runtime_dead`, and
    one error per cause is enough (a Triton kill otherwise showed `runtime_stream_failed` per call in flight)."""
    return failure.code != "stale_fence" and not s.closing and s.stream.broken is None


def _ignore(ev: dict[str, Any], result: Any) -> None:
    return None


def _array(result: Any, name: str, dtype: type) -> np.ndarray:
    arr = result.as_numpy(name)
    return np.zeros(0, dtype) if arr is None else np.asarray(arr, dtype=dtype).reshape(-1)


@dataclass
class _Unit:
    """One appended unit on its way through the stages."""
    index: int
    epoch: int
    started: float = field(default_factory=time.perf_counter)
    held: list[RuntimeEvent] = field(default_factory=list)  # events waiting for the unit before to finish
    done_event: UnitDone | None = None  # stage0's unit_done, sent after the unit's audio
    stage0_open: bool = True  # stage0's request has not ended yet
    speech_calls: int = 0  # tts / token2wav requests of this unit not ended yet
    cancelled: bool = False  # a cancel moved the session past this unit's epoch: start no more stage calls
    # stage -> when its first input of the unit was sent; its first output's times (`first_output`)
    sent: dict[str, float] = field(default_factory=dict)
    firsts: dict[str, dict[str, float]] = field(default_factory=dict)

    def unit_done(self) -> None:
        """Stage0 finished the unit (its `unit_done` came): ms from the unit's append, kept as the metrics'
        `unit_done` entry (the first stage's place in the unit's latency, beside the others' `from_unit_ms`)."""
        self.firsts.setdefault("unit_done", {"from_unit_ms": (time.perf_counter() - self.started) * MS_PER_S})

    def first_output(self, stage: str) -> None:
        """The stage's first output of the unit (protocol.md §10.1): ms from its input being sent
        (`first_output_ms`) and from the unit's append (`from_unit_ms`, the stage's place in the unit's latency)."""
        if stage not in self.firsts:
            now = time.perf_counter()
            self.firsts[stage] = {"first_output_ms": (now - self.sent[stage]) * MS_PER_S,
                                  "from_unit_ms": (now - self.started) * MS_PER_S}

    @property
    def finished(self) -> bool:
        return not self.stage0_open and self.speech_calls == 0


class UnitOrder:
    """A session's units in append order: only the head's events go out, the others are held (module doc),
    except a unit's decision and text behind units that continue one spoken turn (`_early`)."""

    def __init__(self, put: Callable[[RuntimeEvent], None]) -> None:
        self._put = put
        self._units: collections.deque[_Unit] = collections.deque()

    def add(self, unit: _Unit) -> None:
        self._units.append(unit)

    def emit(self, unit: _Unit, ev: RuntimeEvent) -> None:
        if self._units and self._units[0] is unit:
            self._put(ev)
        elif unit in self._units:
            if not unit.held and isinstance(ev, (Decision, TextPiece)) and self._early(unit):
                self._put(ev)
            else:
                unit.held.append(ev)

    def _early(self, unit: _Unit) -> bool:
        """Every unit ahead of `unit` has left stage0 speaking without ending the turn, so `unit` belongs to
        the same response: its decision and text may go out before their audio (targets.md P13)."""
        for ahead in self._units:
            if ahead is unit:
                return True
            done = ahead.done_event
            if done is None or done.is_listen or done.end_of_turn:
                return False
        return False

    def _release_early(self) -> None:
        """The decision and text held by units behind the head that may now go out early (their order kept)."""
        for unit in itertools.islice(self._units, 1, None):
            if not self._early(unit):
                return
            n = next((i for i, ev in enumerate(unit.held) if not isinstance(ev, (Decision, TextPiece))),
                     len(unit.held))
            for ev in unit.held[:n]:
                self._put(ev)
            del unit.held[:n]

    def settle(self) -> None:
        """Send what the finished head units owe (their UnitDone), release the next unit's held events, and
        the decision and text that may go out early."""
        while self._units and self._units[0].finished:
            unit = self._units.popleft()
            if unit.done_event is not None:
                self._put(_with_firsts(unit.done_event, unit.firsts))
            if self._units:
                head = self._units[0]
                for ev in head.held:
                    self._put(ev)
                head.held.clear()
        self._release_early()

    def drop_before(self, epoch: int) -> None:
        """A cancel: units of older epochs emit nothing more (the session rejects their epoch anyway)."""
        for unit in self._units:
            unit.cancelled = unit.cancelled or unit.epoch < epoch
        self._units = collections.deque(u for u in self._units if u.epoch >= epoch)
        if self._units:
            head = self._units[0]
            for ev in head.held:
                self._put(ev)
            head.held.clear()
        self.settle()

    def clear(self) -> None:
        self._units.clear()


def _with_firsts(ev: UnitDone, firsts: dict[str, dict[str, float]]) -> UnitDone:
    if not firsts:
        return ev
    metrics = dict(ev.metrics)
    for stage, times in firsts.items():
        metrics[stage] = dict(times)
    return UnitDone(epoch=ev.epoch, unit=ev.unit, is_listen=ev.is_listen, end_of_turn=ev.end_of_turn, metrics=metrics,
                    forced=ev.forced)


class _Session:
    def __init__(self, client: Any, key: SessionKey, batch_dim: bool) -> None:
        self.events: asyncio.Queue[RuntimeEvent | None] = asyncio.Queue()
        self.order = UnitOrder(self.events.put_nowait)
        self.stream = _Stream(client, key, batch_dim, self._on_broken)
        self.seq = {TTS: 0, TOKEN2WAV: 0}  # stage-internal append_seq (each stage checks its own order)
        self.closing = False  # the close went out: no stage call may start after it (Triton would refuse it)

    def stage_fence(self, base: Fence, stage: str) -> Fence:
        self.seq[stage] += 1
        return Fence(base.incarnation, base.epoch, self.seq[stage])

    def _on_broken(self, failure: RuntimeFailure) -> None:
        self.order.clear()
        self.events.put_nowait(None)


class StagedTritonRuntime:
    def __init__(self, url: str, ready_models: tuple[str, ...] = STAGES, *, batch_dim: bool = True,
                 client: Any = None) -> None:
        self._url, self._ready_models, self._batch_dim = url, ready_models, batch_dim
        self._client = client
        self._sessions: dict[int, _Session] = {}

    def _get_client(self) -> Any:
        if self._client is None:
            from gateway.runtime.grpc_client import triton_client  # noqa: PLC0415 - created on the loop

            self._client = triton_client(self._url)
        return self._client

    def _session(self, key: SessionKey) -> _Session:
        s = self._sessions.get(key.correlation_id)
        if s is None:
            raise RuntimeFailure("session_not_found", "no open sequence for this session")
        return s

    def adopt(self, key: SessionKey) -> None:
        """Bind a stream to a sequence another client opened (a dead gateway's: gateway/directory/sweep.py closes
        it, gateway/directory/adopt.py goes on with it); nothing is sent until the next operation. Triton's
        sequence batcher keys a sequence by its CORRELATION_ID, not by the stream that opened it, so any stream may
        continue it; the stages' fence rule then decides (the new owner's first request is a cancel to a new epoch,
        so the stage-internal append counters of this new stream start afresh without colliding)."""
        if key.correlation_id not in self._sessions:
            self._sessions[key.correlation_id] = _Session(self._get_client(), key, self._batch_dim)

    async def _all_stages(self, s: _Session, op: str, fences: Mapping[str, Fence], **kw: Any) -> None:
        """`op` on every stage at once; the first failure (stage0's first) is raised after all have ended."""
        results = await asyncio.gather(*(s.stream.call(m, op, fences[m], **kw) for m in STAGES),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        s = _Session(self._get_client(), key, self._batch_dim)
        self._sessions[key.correlation_id] = s
        opened: list[str] = []

        async def open_one(model: str) -> None:
            await s.stream.call(model, "open", fence, config=config)
            opened.append(model)

        results = await asyncio.gather(*(open_one(m) for m in STAGES), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            # the stages that did open hold a sequence slot and a session until their idle timeout: end them now
            await asyncio.gather(*(s.stream.call(m, "close", fence) for m in opened if s.stream.broken is None),
                                 return_exceptions=True)
            self._sessions.pop(key.correlation_id, None)
            await s.stream.aclose()
            raise failure

    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        s = self._session(key)
        flow = _Unit(unit.unit_index, fence.epoch)
        s.order.add(flow)

        def on_event(ev: dict[str, Any], result: Any) -> None:
            kind = ev.get("type")
            if kind == "tts_input":
                self._speak(s, fence, flow, ev, result)
                return
            parsed = as_unit(typed_event(ev, None, fence.epoch), flow.index)
            if isinstance(parsed, UnitDone):
                flow.unit_done()
                flow.done_event = parsed
                s.order.settle()  # the units behind it may now send their decision and text
            elif not isinstance(parsed, dict):
                s.order.emit(flow, parsed)

        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_final(failure: RuntimeFailure | None) -> None:
            flow.stage0_open = False
            s.order.settle()
            if not fut.done():
                fut.set_exception(failure) if failure is not None else fut.set_result(None)

        s.stream.send(STAGE0, "append", fence, on_event, on_final, unit=unit)
        await fut

    def _speak(self, s: _Session, fence: Fence, flow: _Unit, ev: dict[str, Any], result: Any) -> None:
        """stage0's `tts_input` -> tts; each of its `audio_tokens` -> token2wav; each `audio` -> the session."""
        if flow.cancelled or s.closing:
            return
        turn = {k: ev[k] for k in TURN_KEYS if k in ev}
        hidden = _array(result, "HIDDEN", np.float32)

        def on_codes(out: dict[str, Any], res: Any) -> None:
            if out.get("type") != "audio_tokens" or out.get("dropped") or flow.cancelled or s.closing:
                return  # nothing to render, or a cancel / the close overtook the unit: nobody would hear it
            flow.first_output("talker")
            flow.sent.setdefault("code2wav", time.perf_counter())
            flow.speech_calls += 1
            s.stream.send(TOKEN2WAV, "append", s.stage_fence(fence, TOKEN2WAV), on_audio, ended,
                          tokens=_array(res, "TOKENS", np.int64), config=speech_config(flow.index, ev, out))

        def on_audio(out: dict[str, Any], res: Any) -> None:
            if out.get("type") != "audio":
                return
            flow.first_output("code2wav")
            piece = as_unit(typed_event(out, _array(res, "AUDIO", np.int16), fence.epoch), flow.index)
            if not isinstance(piece, dict):
                s.order.emit(flow, piece)

        def ended(failure: RuntimeFailure | None) -> None:
            flow.speech_calls -= 1
            if failure is not None and _reportable(failure, s):
                s.order.emit(flow, StreamError(epoch=fence.epoch, code=failure.code, message=failure.message))
            s.order.settle()

        flow.speech_calls += 1
        flow.sent.setdefault("talker", time.perf_counter())
        s.stream.send(TTS, "append", s.stage_fence(fence, TTS), on_codes, ended,
                      tokens=_array(result, "TOKENS", np.int64), hidden=hidden if hidden.size else None,
                      config={"unit": flow.index, **turn})

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        s = self._session(key)
        s.order.drop_before(next_fence.epoch)
        await self._all_stages(s, "cancel", dict.fromkeys(STAGES, fence), next_fence=next_fence)

    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        s = self._session(key)
        await self._all_stages(s, "update", dict.fromkeys(STAGES, fence), config=config)

    async def close(self, key: SessionKey, fence: Fence) -> None:
        s = self._session(key)
        s.closing = True
        try:
            if s.stream.broken is None:  # a dead stream's sequences hold nothing: Triton's idle timeout ends them
                await self._all_stages(s, "close", dict.fromkeys(STAGES, fence))
        except RuntimeFailure as exc:
            # already gone (a stage expired it, or the stream broke meanwhile): closed all the same
            if exc.code not in ("session_not_found", RUNTIME_DEAD):
                raise
        finally:
            self._sessions.pop(key.correlation_id, None)
            s.order.clear()
            await s.stream.aclose()

    async def forget(self, key: SessionKey) -> None:
        """Drop this client's stream of a session without a word to Triton: another gateway took the sequence
        over (gateway/directory/runtime.py, self-fencing), so only the stream here ends."""
        s = self._sessions.pop(key.correlation_id, None)
        if s is not None:
            s.closing = True
            await s.stream.aclose()  # its reader's end ends the session's event stream

    async def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        s = self._session(key)
        while (ev := await s.events.get()) is not None:
            yield ev

    async def readiness(self) -> Readiness:
        return await probe_readiness(self._get_client(), self._ready_models)

    async def aclose(self) -> None:
        for s in list(self._sessions.values()):
            await s.stream.aclose()
        self._sessions.clear()
        if self._client is not None:
            await self._client.close()


def speech_config(unit: int, tts_input: Mapping[str, Any], codes: Mapping[str, Any]) -> dict[str, Any]:
    """token2wav's CONFIG for one `audio_tokens` event: the unit, its turn end (from stage0's `tts_input`) and,
    where the TTS sent the unit in two parts, which part and how many codes the whole unit has."""
    return {"unit": unit, "end_of_turn": bool(tts_input.get("end_of_turn", False)) and codes.get("part") != "head",
            **{k: codes[k] for k in PART_KEYS if k in codes}}
