"""The engine thread every real-engine bridge runs on, plus the shared loading and error helpers.

`submit` / `drop` only enqueue; one thread per model instance owns the engine (and its KV): it applies
queued commands in arrival order, then runs one engine step, and sleeps on the queue while idle. A
request's sink is closed exactly once: by the bridge when its work is done, or here when handling it
raised. An exception inside an engine step fails the requests that step was serving, not the engine.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..codec import RequestError, StageOutput, StageRequest, error_output
from ..metrics import StageMetrics
from ..settings import ConfigError, StageSettings

IDLE_WAIT_S = 0.05  # the idle engine thread wakes this often (a new request wakes it at once)
CPU_THREADS = 1  # torch threads per stage on CPU: three stages share a small machine
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STOP = object()

# Engine error codes (their `code` attribute or class name) -> the codes of docs/triton.md.
ERROR_CODES = {
    "stale_fence": "stale_fence", "StaleFenceError": "stale_fence",
    "invalid_fence": "stale_fence",
    "unknown_session": "session_not_found", "session_closed": "session_not_found",
    "UnknownSessionError": "session_not_found",
    "session_exists": "invalid_request", "SessionExistsError": "invalid_request",
    "bad_audio": "bad_audio",
    "bad_sampling": "invalid_runtime_config", "BadSamplingError": "invalid_runtime_config",
    "too_many_frames": "invalid_request", "front_end": "invalid_request", "bad_frame": "invalid_request",
    "capacity": "runtime_backpressure", "CapacityError": "runtime_backpressure",
    "NoFreeSlotError": "runtime_backpressure", "TurnCapacityError": "runtime_backpressure",
    "HiddenDimError": "invalid_request", "RowCountError": "invalid_request", "TokenIdError": "invalid_request",
    "CodeRangeError": "invalid_request", "UnknownVoiceError": "invalid_runtime_config",
    "UnitPartError": "invalid_request",
}


def engine_error(exc: BaseException) -> StageOutput:
    """A typed engine error -> its documented code; anything else is an `internal_error`."""
    if isinstance(exc, RequestError):
        return error_output(exc.code, exc.message)
    for key in (getattr(exc, "code", None), type(exc).__name__):
        if key in ERROR_CODES:
            return error_output(ERROR_CODES[key], str(exc) or type(exc).__name__)
    return error_output("internal_error", f"{type(exc).__name__}: {exc}")


def torch_dtype(settings: StageSettings) -> torch.dtype:
    return DTYPES[settings.dtype]


def engine_options(settings: StageSettings, known: tuple[str, ...]) -> dict[str, Any]:
    """The stage's `engine_options` parameter (JSON object from the deploy profile), {} when absent."""
    try:
        opts = json.loads(settings.engine_options or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"parameter engine_options is not JSON: {exc}") from exc
    if not isinstance(opts, dict):
        raise ConfigError("parameter engine_options must be a JSON object")
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise ConfigError(f"stage {settings.stage!r}: unknown engine option(s) {unknown}; known: {list(known)}")
    return opts


def count_option(opts: dict[str, Any], stage: str, name: str) -> dict[str, int]:
    """An engine option that counts something (an int >= 0) as an engine config keyword; absent: {} (the
    config's default). Anything else fails the load."""
    if name not in opts:
        return {}
    value = opts[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"engine_options.{stage}.{name} must be an integer >= 0, not {value!r}")
    return {name: value}


def flag_option(opts: dict[str, Any], stage: str, name: str, default: bool = False) -> bool:
    """A boolean engine option; anything but a bool fails the load."""
    value = opts.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"engine_options.{stage}.{name} must be true or false, not {value!r}")
    return value


def session_key(corrid: int) -> str:
    return str(corrid)


def configure_torch(settings: StageSettings) -> None:
    if settings.device == "cpu":
        torch.set_num_threads(CPU_THREADS)
    elif settings.device.startswith("cuda:"):
        # The instance's GPU (settings.instance_device) becomes the current device, so streams, events,
        # graph pools and every `device="cuda"` allocation of this process land on it, not on GPU 0.
        torch.cuda.set_device(torch.device(settings.device))


class EngineBridge:
    """Base of the three bridges: subclasses implement `handle`, `step`, `forget` and `fail_all`."""

    def __init__(self, settings: StageSettings) -> None:
        self.settings = settings
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"{settings.stage}-engine", daemon=True)
        self.metrics = StageMetrics(settings.stage)
        self.metrics.watch_misses(self.graph_misses)
        self.step_rows = 0  # rows the running step serves; each bridge's `step` sets it (batch occupancy)
        self.step_kind: str | None = None  # what the step ran, where a bridge tells (stage0: prefill / decode)
        self.step_token_rows = 0  # of step_rows, those of one decoded token, where a bridge tells (stage0; P12)

    # ---- StageEngine protocol (adapter thread) ------------------------------------------------------
    def start(self) -> None:
        self.metrics.start()
        self._thread.start()

    def submit(self, req: StageRequest, sink: Any) -> None:
        self._queue.put((req, sink, time.perf_counter()))

    def drop(self, corrid: int) -> None:
        self._queue.put((corrid, None, None))

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()
        self.metrics.stop()

    # ---- the engine thread ------------------------------------------------------------------------
    def handle(self, req: StageRequest, sink: Any) -> None:
        """Apply one request to the engine; close `sink` now or keep it until the work is done."""
        raise NotImplementedError

    def step(self) -> bool:
        """One engine step; False when there was no work. Sets `step_rows` to the rows the step serves (and may
        set `step_kind` and `step_token_rows`)."""
        raise NotImplementedError

    def forget(self, corrid: int) -> None:
        """The adapter forgot the session (close or idle expiry): free its engine state."""
        raise NotImplementedError

    def fail_all(self, out: StageOutput) -> None:
        """Close every pending sink with `out` (an engine step raised)."""
        raise NotImplementedError

    def warm_up(self, emit: Callable[[str], None]) -> None:
        """Build every graph / compiled step the engine may use, before the stage reports ready (the
        adapter calls this in `initialize`); `emit` takes the progress lines. Nothing to build by default."""

    def graph_misses(self) -> dict[str, int]:
        """Calls since warm-up whose shape found no prebuilt graph, per kind (engine/warmup.py)."""
        return {}

    def _loop(self) -> None:
        busy = False
        while True:
            try:
                item = self._queue.get_nowait() if busy else self._queue.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                req, sink, submitted = item
                if submitted is not None:
                    self.metrics.queue_wait(time.perf_counter() - submitted)
                self._apply(req, sink)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            try:
                self.step_rows, self.step_kind, self.step_token_rows = 0, None, 0
                started = time.perf_counter()
                busy = self.step()
                if self.step_rows:
                    self.metrics.step(self.step_rows, time.perf_counter() - started, self.step_kind,
                                      self.step_token_rows)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
                traceback.print_exc()
                self.fail_all(engine_error(exc))
                busy = False

    def _apply(self, req: StageRequest | int, sink: Any) -> None:
        if sink is None:
            self._guard(lambda: self.forget(req))  # type: ignore[arg-type]
            return
        try:
            self.handle(req, sink)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - one failing request must not stop the engine
            if not isinstance(exc, RequestError) and engine_error(exc).event["code"] == "internal_error":
                traceback.print_exc()
            sink.emit(engine_error(exc))
            sink.close()

    @staticmethod
    def _guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - cleanup of a session that is gone anyway
            traceback.print_exc()


def control_event(req: StageRequest, stage: str) -> StageOutput:
    names = {"open": "opened", "update": "updated", "cancel": "cancelled", "close": "closed"}
    return StageOutput({"type": names[req.op], "stage": stage, "fence": list(req.fence)})
