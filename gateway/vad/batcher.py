"""Server VAD batched across sessions: one onnxruntime call per round instead of one per session and window.

Sessions hand in the whole 32 ms windows of an append with their recurrent state and await the probabilities.
A session's windows are sequential through its state, so a flush runs in rounds: round r runs the r-th window
of every request that has one, B = those requests, as one `SileroVad.run` on [B, 576] and [2, B, 128]. A row's
output does not depend on the other rows (bitwise; tests/gateway/test_vad_batch.py), so a session sees exactly
what `SileroVad.window_probability` window by window would give it, whoever shares its rounds.

The flush runs on the event loop, scheduled with `call_soon` by the first request after the last flush: it takes
what the sessions handed in up to the loop's next iteration. No timer: a session alone waits one iteration; under
load, iterations are long and the rounds fill. Pending requests of a cancelled call (a closing session) are
dropped before they run. An ORT failure of a round is retried row by row, so it fails only the calls whose own
row fails, with the exception ORT raised (as the one-stream path raises it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from gateway.vad.model import CONTEXT_SAMPLES, STATE_SHAPE, WINDOW_SAMPLES, SileroVad, VadState


@dataclass(slots=True, eq=False)
class _Request:
    state: VadState  # the session's; written only by the flush while its owner awaits `done`
    windows: np.ndarray  # [n, 512] float32
    probs: np.ndarray  # [n] float32, filled round by round
    done: asyncio.Future[np.ndarray]


@dataclass(slots=True)
class BatchStats:
    flushes: int = 0
    rounds: int = 0  # ORT calls
    windows: int = 0  # rows over all rounds: windows / rounds is the mean batch

    @property
    def mean_batch(self) -> float:
        return self.windows / self.rounds if self.rounds else 0.0


class VadBatcher:
    """The process's one batcher over the process's one model; used from one event loop."""

    def __init__(self, model: SileroVad) -> None:
        self.model = model
        self.stats = BatchStats()
        self._queue: list[_Request] = []
        self._flush_at: asyncio.Handle | None = None

    async def probabilities(self, state: VadState, windows: np.ndarray) -> np.ndarray:
        """windows [n, 512] float32 -> [n] float32; advances `state` by n windows, as n `window_probability`s."""
        if windows.ndim != 2 or windows.shape[1] != WINDOW_SAMPLES:
            raise ValueError(f"windows must be [n, {WINDOW_SAMPLES}], got {list(windows.shape)}")
        if not len(windows):
            return np.empty(0, np.float32)
        loop = asyncio.get_running_loop()
        req = _Request(state, windows.astype(np.float32, copy=False), np.empty(len(windows), np.float32),
                       loop.create_future())
        self._queue.append(req)
        if self._flush_at is None:
            self._flush_at = loop.call_soon(self._flush)
        return await req.done  # a cancel here cancels `done`: the flush skips the request

    def _flush(self) -> None:
        self._flush_at = None
        batch, later, seen = [], [], set()
        for req in self._queue:
            if req.done.done():
                continue  # cancelled: its session is closing
            # NOTE: a state's second request must see the first's result: it waits for the next flush
            (later if id(req.state) in seen else batch).append(req)
            seen.add(id(req.state))
        self._queue = later
        if later:
            self._flush_at = asyncio.get_running_loop().call_soon(self._flush)
        try:
            self._run(batch)
        except BaseException as exc:  # a bug here must not leave sessions waiting for ever
            for req in batch:
                if not req.done.done():
                    req.done.set_exception(exc)
            raise
        for req in batch:
            if not req.done.done():
                req.done.set_result(req.probs)

    def _run(self, batch: list[_Request]) -> None:
        """One round per window position: collect the rows -> one ORT call -> scatter."""
        self.stats.flushes += 1
        for r in range(max((len(req.windows) for req in batch), default=0)):
            rows = [req for req in batch if r < len(req.windows) and not req.done.done()]
            if not rows:
                break  # later rounds hold a subset of these requests
            try:
                self._round(rows, r)
            except Exception as exc:  # noqa: BLE001 - isolated below: only a failing row's call fails
                self._isolate(rows, r, exc)

    def _isolate(self, rows: list[_Request], r: int, exc: Exception) -> None:
        if len(rows) == 1:
            rows[0].done.set_exception(exc)
            return
        for req in rows:
            try:
                self._round([req], r)
            except Exception as row_exc:  # noqa: BLE001 - handed to that session's call as ORT raised it
                req.done.set_exception(row_exc)

    def _round(self, rows: list[_Request], r: int) -> None:
        b = len(rows)
        x = np.empty((b, CONTEXT_SAMPLES + WINDOW_SAMPLES), np.float32)  # [B, 576]
        rnn = np.empty((STATE_SHAPE[0], b, STATE_SHAPE[2]), np.float32)  # [2, B, 128]
        for i, req in enumerate(rows):
            x[i, :CONTEXT_SAMPLES] = req.state.context
            x[i, CONTEXT_SAMPLES:] = req.windows[r]
            rnn[:, i] = req.state.rnn[:, 0]
        probs, rnn_out = self.model.run(x, rnn)  # [B], [2, B, 128]
        self.stats.rounds += 1
        self.stats.windows += b
        for i, req in enumerate(rows):
            req.probs[r] = probs[i]
            req.state.rnn = rnn_out[:, i:i + 1].copy()  # [2, 1, 128]
            req.state.context = x[i, -CONTEXT_SAMPLES:].copy()  # [64]

