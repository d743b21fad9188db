"""Loopback engines: a torch-free test double of the three stage engines (speaks the stage protocol).

They let the Triton plumbing tests (sequences, decoupled fan-out, fences, errors, the pipeline) pin
exact decisions: stage0 decides `speak` when a unit's RMS passes a threshold and emits text tokens plus
a `tts_input` payload; tts maps text tokens to audio tokens; token2wav renders each as a short tone.
Served by a test profile with `engine: tests.triton.loopback` (its `stage0`/`tts`/`token2wav` below);
the tritonserver stub reaches this module through the repo root on its PYTHONPATH.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from model_repository.common.codec import RequestError, StageOutput, StageRequest, error_output
from model_repository.common.settings import StageSettings

FIRST_UNIT_SAMPLES = 16_480  # unit 0 is 1030 ms of 16 kHz audio (spec/model.md)
UNIT_SAMPLES = 16_000
SPEAK_RMS = 0.01  # a unit louder than this is "speech" for the loopback decision
TEXT_TOKENS_PER_UNIT = 4
OUTPUT_RATE = 24_000
SAMPLES_PER_AUDIO_TOKEN = 960  # 25 audio tokens per second at 24 kHz
TONE_AMPLITUDE = 8_000
TONE_BASE_HZ = 200.0
FAIL_CONFIG_KEY = "loopback_fail"  # CONFIG {"loopback_fail": true} raises inside the engine (error tests)

Handler = Callable[[StageRequest], list[StageOutput]]


class EngineThread:
    """One worker thread running a synchronous handler per request, in arrival order."""

    def __init__(self, name: str, handle: Handler) -> None:
        self._handle, self._queue = handle, queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.units: dict[int, int] = {}  # corrid -> units seen; only the engine thread touches it

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: StageRequest, sink) -> None:
        self._queue.put((req, sink))

    def drop(self, corrid: int) -> None:
        self._queue.put(("drop", corrid))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            req, sink = item
            if req == "drop":
                self.units.pop(sink, None)
                continue
            try:
                for out in self._handle(req):
                    sink.emit(out)
            except RequestError as exc:
                sink.emit(error_output(exc.code, exc.message))
            except Exception as exc:  # noqa: BLE001 - one failing request must not stop the engine
                sink.emit(error_output("internal_error", f"{type(exc).__name__}: {exc}"))
            finally:
                sink.close()


@dataclass
class _Stage:
    settings: StageSettings
    units: dict[int, int]

    def control(self, req: StageRequest) -> list[StageOutput] | None:
        if req.config and req.config.get(FAIL_CONFIG_KEY):
            raise RuntimeError("loopback failure requested by CONFIG")
        names = {"open": "opened", "update": "updated", "cancel": "cancelled", "close": "closed"}
        if req.op in names:
            if req.op == "open":
                self.units[req.corrid] = 0
            return [StageOutput({"type": names[req.op], "stage": self.settings.stage, "fence": list(req.fence)})]
        return None


def _stage0(stage: _Stage, req: StageRequest) -> list[StageOutput]:
    if (done := stage.control(req)) is not None:
        return done
    unit = stage.units.get(req.corrid, 0)
    want = FIRST_UNIT_SAMPLES if unit == 0 else UNIT_SAMPLES
    if req.pcm is None or req.pcm.size != want:
        raise RequestError("bad_audio", f"unit {unit} needs {want} samples, got {0 if req.pcm is None else req.pcm.size}")
    stage.units[req.corrid] = unit + 1
    rms = float(np.sqrt(np.mean(np.square(req.pcm))))
    speak = rms > SPEAK_RMS and not req.force_listen
    action = "speak" if speak else "listen"
    outs = [StageOutput({"type": "decision", "action": action, "decision": action, "unit": unit})]
    if speak:
        ids = (np.arange(TEXT_TOKENS_PER_UNIT) + unit * TEXT_TOKENS_PER_UNIT).astype(np.int64)
        outs += [StageOutput({"type": "text", "token_id": int(t), "text": f"<{int(t)}>", "unit": unit}) for t in ids]
        outs.append(StageOutput({"type": "tts_input", "unit": unit}, tokens=ids))
    outs.append(StageOutput({"type": "unit_done", "unit": unit, "is_listen": not speak, "end_of_turn": False,
                             "metrics": {"rms": rms}}))
    return outs


def _tts(stage: _Stage, req: StageRequest) -> list[StageOutput]:
    if (done := stage.control(req)) is not None:
        return done
    if req.tokens is None:
        raise RequestError("invalid_request", "tts append needs TOKENS (text token ids)")
    unit = stage.units.get(req.corrid, 0)
    stage.units[req.corrid] = unit + 1
    audio_tokens = np.repeat(req.tokens % 64, 2)  # two audio tokens per text token
    return [StageOutput({"type": "audio_tokens", "unit": unit, "count": int(audio_tokens.size)}, tokens=audio_tokens)]


def _token2wav(stage: _Stage, req: StageRequest) -> list[StageOutput]:
    if (done := stage.control(req)) is not None:
        return done
    if req.tokens is None:
        raise RequestError("invalid_request", "token2wav append needs TOKENS (audio token ids)")
    seq = stage.units.get(req.corrid, 0)
    stage.units[req.corrid] = seq + 1
    t = np.arange(SAMPLES_PER_AUDIO_TOKEN) / OUTPUT_RATE
    tones = [np.sin(2 * np.pi * (TONE_BASE_HZ + 10 * int(k)) * t) for k in req.tokens]
    audio = (np.concatenate(tones) * TONE_AMPLITUDE).astype(np.int16)
    unit = int(req.config.get("unit", seq)) if req.config else seq
    return [StageOutput({"type": "audio", "unit": unit, "seq": seq, "samples": int(audio.size)}, audio=audio)]


_HANDLERS = {"stage0": _stage0, "tts": _tts, "token2wav": _token2wav}


def make_engine(settings: StageSettings) -> EngineThread:
    units: dict[int, int] = {}
    stage = _Stage(settings, units)
    handler = _HANDLERS[settings.stage]
    engine = EngineThread(f"{settings.stage}-engine", lambda req: handler(stage, req))
    engine.units = units
    return engine


stage0 = tts = token2wav = make_engine  # engine_factory `tests.triton.loopback:<stage>`
