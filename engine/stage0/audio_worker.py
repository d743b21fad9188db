"""The batched audio front end on its own thread, off the step's critical path (issue 14/15).

Measured on the H200 (bench/RESULTS.md, py-spy of the served stage0 at 16 sessions): the front end took
76 % of the engine thread while the thread used half a core, i.e. it mostly waited on the GPU; every
session's decode step waited with it. Here the engine step only hands the units it starts to this
worker and goes on with the other sessions' rows; a unit is prefilled in the first step after its
embeddings are ready. The worker takes every unit handed over since its last call as one batch (the
sessions that have a unit ready), on its own CUDA stream, and publishes the embeddings only after that
stream finished, so the engine's stream reads complete values.

Only units the engine has started reach the worker, as before: a unit a cancel drops from the queue
never reaches the mel stream (engine/stage0/frontend.py), and units of one session arrive here in order
(the next unit starts after the previous one finished). Each session's streaming state is touched by
this thread alone while the worker runs.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.stage0.session import UnitRun

EncodeUnits = Callable[[list[Any], list[torch.Tensor]], Sequence[torch.Tensor]]


class AudioWorker:
    def __init__(self, encode_units: EncodeUnits, device: torch.device | str) -> None:
        self._encode = encode_units
        self._device = torch.device(device)
        self._pending: list[tuple[Any, UnitRun]] = []
        self._in_flight = 0  # units handed over and not yet published
        self._batches = 0  # batches published so far
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="stage0-audio", daemon=True)
        cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if cuda else None
        # the stream the engine reads the embeddings on: every thread's default (legacy) stream
        self._consumer = torch.cuda.default_stream(self._device) if cuda else None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, runs: list[tuple[Any, UnitRun]]) -> None:
        """(front-end state, unit) pairs whose `audio_embeds` the worker will set (a tensor, or the
        exception that failed their batch)."""
        for _, unit in runs:
            unit.audio_submitted = True
        with self._cond:
            self._pending.extend(runs)
            self._in_flight += len(runs)
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._in_flight > 0

    def wait(self, timeout_s: float) -> None:
        """Until the next batch is published, nothing is in flight, or `timeout_s` passed."""
        with self._cond:
            seen = self._batches
            self._cond.wait_for(lambda: self._batches > seen or self._in_flight == 0 or self._stopping, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending) or self._stopping)
                if self._stopping:
                    return
                runs, self._pending = self._pending, []
            out = self._encode_batch(runs)
            for (_, unit), audio in zip(runs, out, strict=True):
                unit.audio_embeds = audio
            with self._cond:
                self._in_flight -= len(runs)
                self._batches += 1
                self._cond.notify_all()

    def _encode_batch(self, runs: list[tuple[Any, UnitRun]]) -> list[torch.Tensor | Exception]:
        try:
            if self._stream is None:
                return list(self._encode([s for s, _ in runs], [u.job.pcm for _, u in runs]))
            with torch.cuda.stream(self._stream):
                out = list(self._encode([s for s, _ in runs], [u.job.pcm for _, u in runs]))
                for t in out:  # freed later on the engine's thread: not reused before its reads ran
                    t.record_stream(self._consumer)
            self._stream.synchronize()  # published only when complete (releases the GIL while it waits)
            return out
        except Exception as exc:  # noqa: BLE001 - the states may have advanced: these units fail, not the engine
            traceback.print_exc()
            return [exc] * len(runs)
