"""The decoupled, sequence-keyed Python-backend adapter every stage model subclasses.

`initialize` validates the config, builds the engine and warms it up (every graph and compiled step its
profile allows, progress in the log: Triton reports the model, and so the gateway's /ready, ready only
once `initialize` returns), then starts it; `execute` parses, checks the fence and hands
each request to the engine with a ResponseSink, then returns None (decoupled); one response thread
owns every `response_sender.send`; every request ends with exactly one FINAL flag, also after an
error, a client cancel or an unload; `finalize` stops the engine and drains with a sentinel.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import traceback
from typing import Any, Protocol

import numpy as np
import triton_python_backend_utils as pb_utils

from .codec import (
    COALESCE_PARAMETER,
    INPUT_NAMES,
    RequestError,
    StageOutput,
    StageRequest,
    coalesce,
    error_output,
    output_arrays,
    parse_request,
)
from .occupancy import SessionGauge
from .sessions import SessionTable
from .settings import StageSettings, cap_mps_threads, instance_device, load_factory, session_expiry_s
from .workarounds import pin_object_dtype, report_fatal_signals, utf8_text_files

_SENTINEL = object()


class ResponseSink:
    """One request's way back: `emit` any number of outputs, then `close` once (sends FINAL).

    `coalesced`: the caller asked for one response (request parameter `coalesce`): outputs are held and
    `close` sends them as one `batch` output together with FINAL (codec.coalesce).
    """

    def __init__(self, sender: Any, outbox: queue.Queue[Any], live: set[ResponseSink], lock: threading.Lock,
                 coalesced: bool = False) -> None:
        self._sender, self._outbox, self._live, self._lock = sender, outbox, live, lock
        self._held: list[StageOutput] | None = [] if coalesced else None
        self.closed = False
        self.cancelled = False  # set by the response thread when the client cancelled the request

    def emit(self, out: StageOutput) -> None:
        if self._held is None:  # streaming: no lock on the per-event path
            if not self.closed:
                self._outbox.put((self, out, False))
            return
        with self._lock:  # held outputs are read by `close`, possibly on another thread
            if not self.closed:
                self._held.append(out)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._live.discard(self)
            last = coalesce(self._held) if self._held is not None else None
        self._outbox.put((self, last, True))


class StageEngine(Protocol):
    """What the adapter needs from an engine; `submit` must not block (the engine thread does work)."""

    def start(self) -> None: ...

    def submit(self, req: StageRequest, sink: ResponseSink) -> None: ...

    def drop(self, corrid: int) -> None: ...

    def stop(self) -> None: ...


def decoupled_setup(args: dict[str, Any]) -> tuple[StageSettings, SessionTable]:
    """What every model here does first: stub workarounds, the decoupled check, settings, sessions."""
    pin_object_dtype()
    report_fatal_signals()
    utf8_text_files()
    model_config = json.loads(args["model_config"])
    if not pb_utils.using_decoupled_model_transaction_policy(model_config):
        raise pb_utils.TritonModelException(f"{args['model_name']}: must be decoupled (model_transaction_policy)")
    settings = StageSettings.from_model_config(model_config)
    settings = dataclasses.replace(settings, device=instance_device(settings.device, args))
    cap_mps_threads(settings)  # before the engine creates the CUDA context
    return settings, SessionTable(settings.max_sessions, session_expiry_s(settings, model_config))


class DecoupledStageModel:
    """Subclass as `TritonPythonModel` in a model.py; nothing else is needed per stage."""

    def initialize(self, args: dict[str, Any]) -> None:
        self.settings, self.sessions = decoupled_setup(args)
        self.gauge = SessionGauge(self.settings.stage, self.settings.max_sessions)  # replica routing reads it
        self.engine: StageEngine = load_factory(self.settings.engine_factory)(self.settings)
        if self.settings.mps_thread_percentage:
            _log_sm_share(self.settings)
        warm_up(self.engine, self.settings.stage)
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._live: set[ResponseSink] = set()
        self._lock = threading.Lock()
        self._sender_thread = threading.Thread(target=self._send_loop, name=f"{self.settings.stage}-responses",
                                               daemon=True)
        self._sender_thread.start()
        self.engine.start()

    def execute(self, requests: list[Any]) -> None:
        for corrid in self.sessions.expire_idle():
            self.engine.drop(corrid)
        for request in requests:
            if is_null_request(request):
                continue  # a batch slot's filler, not a request: nothing may be sent on it
            sink = ResponseSink(request.get_response_sender(), self._outbox, self._live, self._lock,
                                coalesced=wants_coalesced(request))
            with self._lock:
                self._live.add(sink)
            try:
                req = parse_request(lambda name, r=request: _input(r, name), *_sequence(request))
                self.sessions.admit(req)
                self.engine.submit(req, sink)
                if req.op == "close":
                    self.engine.drop(req.corrid)
            except RequestError as exc:
                sink.emit(error_output(exc.code, exc.message))
                sink.close()
            except Exception as exc:  # noqa: BLE001 - an exception fails only this request
                sink.emit(error_output("internal_error", f"{type(exc).__name__}: {exc}"))
                sink.close()
                pb_utils.Logger.log_error(traceback.format_exc())
        self.gauge.update(len(self.sessions))
        return None

    def finalize(self) -> None:
        self.engine.stop()
        self.gauge.release()
        with self._lock:
            live = list(self._live)
        for sink in live:
            sink.emit(error_output("internal_error", "model is unloading"))
            sink.close()
        self._outbox.put(_SENTINEL)
        self._sender_thread.join()

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not _SENTINEL:
            sink, out, final = item
            if out is not None and not final:
                final = self._take_close(sink)
            sender = sink._sender
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            try:
                if out is not None and (sink.cancelled or sender.is_cancelled()):
                    sink.cancelled = True  # engines may poll this to stop early; FINAL still follows
                    out = None
                if out is None:
                    if final:
                        sender.send(flags=flags)
                    continue
                tensors = [pb_utils.Tensor(k, v) for k, v in output_arrays(out).items()]
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
            except Exception:  # noqa: BLE001 - a dead stream must not stop other sessions' responses
                pb_utils.Logger.log_error(traceback.format_exc())

    def _take_close(self, sink: ResponseSink) -> bool:
        """Whether the next queued item is `sink`'s bare close, taken off the queue: an engine closes a request
        right after its last output, so FINAL rides on that output. One response where two went out (an
        empty FINAL each), a gRPC message fewer per request for Triton and for the gateway's stream reader."""
        with self._outbox.mutex:
            waiting = self._outbox.queue
            if waiting and waiting[0] is not _SENTINEL and waiting[0][0] is sink and waiting[0][1] is None \
                    and waiting[0][2]:
                waiting.popleft()
                return True
        return False


def _log_sm_share(settings: StageSettings) -> None:
    """The SMs this process may use, as CUDA reports them under the MPS cap (all of them: the cap came too late)."""
    import torch  # only a cuda profile caps MPS threads, and a cuda stage runs torch

    sms = torch.cuda.get_device_properties(torch.device(settings.device)).multi_processor_count
    pb_utils.Logger.log_info(f"{settings.stage}: MPS thread percentage {settings.mps_thread_percentage}: "
                             f"this process may use {sms} SMs")


def warm_up(engine: Any, stage: str) -> None:
    """The engine's `warm_up(emit)`, if it has one, with its progress lines in Triton's log."""
    warm = getattr(engine, "warm_up", None)
    if warm is None:
        return
    t0 = time.perf_counter()
    pb_utils.Logger.log_info(f"{stage}: warm-up starts (the model turns ready after it)")
    warm(lambda line: pb_utils.Logger.log_info(f"{stage}: {line}"))
    pb_utils.Logger.log_info(f"{stage}: warm-up finished in {time.perf_counter() - t0:.1f} s")


def _input(request: Any, name: str) -> Any:
    """A copy of one input: `as_numpy` views shared memory that Triton frees once execute returns."""
    tensor = pb_utils.get_input_tensor_by_name(request, name) if name in INPUT_NAMES else None
    return None if tensor is None else np.array(tensor.as_numpy(), copy=True)


def wants_coalesced(request: Any) -> bool:
    """The BLS caller's request parameter `coalesce` (codec.COALESCE_PARAMETER)."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError):
        return False
    return isinstance(params, dict) and params.get(COALESCE_PARAMETER) is True


def _control(request: Any, name: str) -> int:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return 0 if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


def is_null_request(request: Any) -> bool:
    """The direct sequence batcher fills the batch slots of idle sequences with null requests (READY 0).

    NOTE: they carry zeroed copies of a real request's inputs; answering one (an `invalid_request`
    error for its empty OP, then FINAL) corrupted the stub's heap under perf_analyzer's overlapping
    sequences ("malloc(): unaligned fastbin chunk detected", then "Stub process ... is not healthy").
    """
    tensor = pb_utils.get_input_tensor_by_name(request, "READY")
    return tensor is not None and not int(tensor.as_numpy().reshape(-1)[0])


def _sequence(request: Any) -> tuple[int, bool, bool]:
    """(CORRELATION_ID, START, END) from the sequence batcher's control inputs."""
    corrid = _control(request, "CORRID") or int(request.correlation_id() or 0)
    return corrid, bool(_control(request, "START")), bool(_control(request, "END"))
