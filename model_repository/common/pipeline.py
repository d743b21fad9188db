"""The `duplex` pipeline model: per-session decoupled BLS chaining stage0 -> tts -> token2wav.

`execute` runs each request to its end on the stub's execute thread: an `append` forwards stage0's
events for the unit; each `tts_input` payload goes to tts and each `audio_tokens` payload on to
token2wav, whose `audio` events (PCM in AUDIO) reach the client as each call returns and before
stage0's `unit_done`. Payload-only events never reach the client. Every stage call returns all its
outputs in one response (`_outputs` says why), so stage0's decisions and text for a unit reach the
client when stage0 has finished that unit, not token by token.

Synchronous on purpose: one instance runs one request at a time, so there is no lock and no
thread touching pb_utils besides the execute thread. Concurrency across sessions comes from
`pipeline_instances` stub processes (a sequence stays on one instance) and the stage engines batch
across them. A cancel waits for the unit in flight on its own sequence; the sequence batcher would
hold it back until then anyway. Every tensor taken from a request or a BLS response is copied: the
views from `as_numpy` point into shared memory that is freed under us (docs/triton.md).
"""

from __future__ import annotations

import json
import time
import traceback
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from .adapter import _input, _sequence, decoupled_setup, is_null_request
from .codec import (
    COALESCE_PARAMETER,
    OUTPUT_NAMES,
    RequestError,
    StageOutput,
    StageRequest,
    error_output,
    output_arrays,
    parse_request,
    request_arrays,
    split,
)
from .workarounds import Graveyard

STAGE0, TTS, TOKEN2WAV = "stage0", "tts", "token2wav"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TURN_KEYS = ("is_turn_eos", "end_of_turn", "turn_start")  # tts_input fields the tts stage needs
PART_KEYS = ("part", "unit_codes")  # an audio_tokens event's unit part, passed on to token2wav
MS_PER_S = 1000.0


def _bls(model: str, req: StageRequest, fence: tuple[int, int, int], **payload: Any) -> Any:
    """A BLS request to a stage on the session's sequence (same CORRELATION_ID, START/END from req),
    asking for one coalesced response (see `_outputs`)."""
    arrays = request_arrays(req.op, fence, next_fence=req.next_fence, config=payload.pop("config", req.config),
                            **payload)
    flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if req.start else 0) | (
        pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if req.end else 0)
    return pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor(k, v) for k, v in arrays.items()],
                                     requested_output_names=list(OUTPUT_NAMES), correlation_id=req.corrid,
                                     flags=flags, parameters={COALESCE_PARAMETER: True})


def _outputs(model: str, request: Any, graveyard: Graveyard) -> list[StageOutput]:
    """Every output of one decoupled BLS call.

    NOTE: the 2.51 stub builds each arriving BLS response (numpy arrays included) on its parent-to-stub
    thread without taking the GIL, so Python running on this thread while a response arrives corrupts
    the heap (segfaults, "double free or corruption", dtype refcount errors: docs/triton.md). Hence the
    stage answers with ONE response carrying FINAL (`coalesce`), and the iterator is drained before any
    Python work on its responses: nothing of this call can arrive after that. The call's objects then go
    to the graveyard so that the stub's own cleanup never frees Python objects off this thread.
    """
    responses = request.exec(decoupled=True)
    received = list(responses)
    graveyard.keep(request, responses, received)  # released later, on this thread (workarounds.Graveyard)
    outs: list[StageOutput] = []
    for resp in received:
        if resp.has_error():
            raise RequestError("internal_error", f"{model}: {resp.error().message()}")
        if not resp.output_tensors():
            continue  # an empty response carrying FINAL
        # Copies: the arrays outlive `resp`, whose shared memory goes with the iterator.
        out = {n: np.array(pb_utils.get_output_tensor_by_name(resp, n).as_numpy(), copy=True) for n in OUTPUT_NAMES}
        outs.extend(split(StageOutput(json.loads(out["EVENT"].reshape(-1)[0]), audio=out["AUDIO"].reshape(-1),
                                      tokens=out["TOKENS"].reshape(-1), hidden=out["HIDDEN"].reshape(-1))))
    return outs



class _Client:
    """One request's response sender; FINAL is sent exactly once, by `finish`."""

    def __init__(self, sender: Any) -> None:
        self.sender, self.done = sender, False

    def emit(self, out: StageOutput) -> None:
        if self.done or self.sender.is_cancelled():
            return  # a cancelled request still gets FINAL from `finish`
        tensors = [pb_utils.Tensor(k, v) for k, v in output_arrays(out).items()]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors))

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.sender.send(flags=FINAL)


class PipelineModel:
    def initialize(self, args: dict[str, Any]) -> None:
        self.settings, self.sessions = decoupled_setup(args)
        self._seq: dict[tuple[int, str], int] = {}  # stage-internal append_seq per (session, stage)
        self._graveyard = Graveyard()

    def _call(self, model: str, req: StageRequest, fence: tuple[int, int, int], **payload: Any
              ) -> list[StageOutput]:
        return _outputs(model, _bls(model, req, fence, **payload), self._graveyard)

    def execute(self, requests: list[Any]) -> None:
        for corrid in self.sessions.expire_idle():
            self._forget(corrid)
        for request in requests:
            if not is_null_request(request):  # batch-slot fillers get no response (adapter.is_null_request)
                self._run(request, _Client(request.get_response_sender()))
        return None

    def finalize(self) -> None:
        self._seq.clear()
        self._graveyard.release_all()

    def _forget(self, corrid: int) -> None:
        for stage in (TTS, TOKEN2WAV):
            self._seq.pop((corrid, stage), None)

    def _next_fence(self, req: StageRequest, stage: str) -> tuple[int, int, int]:
        seq = self._seq[(req.corrid, stage)] = self._seq.get((req.corrid, stage), 0) + 1
        return (req.fence[0], req.fence[1], seq)

    def _run(self, request: Any, client: _Client) -> None:
        req = None
        try:
            req = parse_request(lambda name: _input(request, name), *_sequence(request))
            self.sessions.admit(req)
            if req.op == "append":
                self._append(req, client)
            else:
                self._broadcast(req, client)
        except RequestError as exc:
            client.emit(error_output(exc.code, exc.message))
        except Exception as exc:  # noqa: BLE001 - fails only this request
            client.emit(error_output("internal_error", f"{type(exc).__name__}: {exc}"))
            pb_utils.Logger.log_error(traceback.format_exc())
        finally:
            if req is not None and req.op == "close":
                self._forget(req.corrid)
            client.finish()

    def _broadcast(self, req: StageRequest, client: _Client) -> None:
        """open/update/cancel/close go to every stage; the client sees stage0's events and any error."""
        for model in (STAGE0, TTS, TOKEN2WAV):
            for out in self._call(model, req, req.fence):
                if model == STAGE0 or out.event.get("type") == "error":
                    client.emit(out)

    def _append(self, req: StageRequest, client: _Client) -> None:
        """Stage0's decisions and text first, then speech (`tts_input` and `unit_done` are stage0's last
        events anyway); one BLS call at a time."""
        started, firsts = time.perf_counter(), _Firsts()
        speak, done = [], None
        for out in self._call(STAGE0, req, req.fence, pcm=req.pcm, frames=req.frames, force_listen=req.force_listen):
            kind = out.event.get("type")
            if kind == "tts_input":
                speak.append(out)
            elif kind == "unit_done":
                done = out.event  # held back: the unit's audio goes first
            else:
                client.emit(StageOutput(out.event))
        for tts_in in speak:
            self._speak(req, tts_in, client, started, firsts)
        if done is not None:
            client.emit(StageOutput(_with_stage_metrics(done, firsts)))

    def _speak(self, req: StageRequest, tts_in: StageOutput, client: _Client, started: float,
               firsts: _Firsts) -> None:
        ev = tts_in.event
        unit = ev.get("unit")
        turn = {k: ev[k] for k in TURN_KEYS if k in ev}
        sub = StageRequest(corrid=req.corrid, op="append", fence=req.fence)
        firsts.send("talker")
        codes = list(self._call(TTS, sub, self._next_fence(req, TTS), tokens=tts_in.tokens,
                           hidden=_or_none(tts_in.hidden), config={"unit": unit, **turn}))
        for tts_out in codes:
            if tts_out.event.get("type") != "audio_tokens":
                client.emit(StageOutput(tts_out.event))
                continue
            if tts_out.event.get("dropped"):
                continue  # cancelled inside tts: nothing to render
            firsts.output("talker", started)
            firsts.send("code2wav")
            part = {k: tts_out.event[k] for k in PART_KEYS if k in tts_out.event}  # a turn's first codes, sent early
            end = bool(ev.get("end_of_turn", False)) and part.get("part") != "head"
            for wav in self._call(TOKEN2WAV, sub, self._next_fence(req, TOKEN2WAV), tokens=tts_out.tokens,
                                  config={"unit": unit, "end_of_turn": end, **part}):
                if wav.event.get("type") == "audio":
                    firsts.output("code2wav", started)
                client.emit(StageOutput(wav.event, audio=wav.audio))


class _Firsts:
    """Per stage: when its first input of the unit went out, and its first output's times (protocol.md §10.1):
    ms from that input (`first_output_ms`) and from the unit's append (`from_unit_ms`)."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.times: dict[str, dict[str, float]] = {}

    def send(self, stage: str) -> None:
        self.sent.setdefault(stage, time.perf_counter())

    def output(self, stage: str, started: float) -> None:
        if stage not in self.times:
            now = time.perf_counter()
            self.times[stage] = {"first_output_ms": (now - self.sent[stage]) * MS_PER_S,
                                 "from_unit_ms": (now - started) * MS_PER_S}


def _with_stage_metrics(event: dict[str, Any], firsts: _Firsts) -> dict[str, Any]:
    """unit_done metrics as the gateway reads them: stage0's `thinker` + `talker`/`code2wav` first output."""
    metrics = dict(event.get("metrics") or {})
    for stage, times in firsts.times.items():
        metrics[stage] = dict(times)
    return {**event, "metrics": metrics}


def _or_none(arr: np.ndarray | None) -> np.ndarray | None:
    return arr if arr is not None and arr.size else None
