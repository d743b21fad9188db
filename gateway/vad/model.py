"""Silero VAD (v5/v6 ONNX) on onnxruntime: one shared `InferenceSession`, explicit per-session state.

The model file ships inside the installed `silero_vad` package; it is located with `find_spec`, which does
not execute the package (its `__init__` imports torch, which the gateway never loads).

Model I/O at 16 kHz (protocol.md §8.2: 512-sample = 32 ms windows):
    input  [1, 64 + 512] float32  (the previous window's last 64 samples, then the new window)
    state  [2, 1, 128]   float32  (recurrent state, zeros at start)
    sr     []            int64    (16000)
    -> output [1, 1] speech probability, stateN [2, 1, 128]

The batch dimension is real: `run` takes B windows of B independent streams ([B, 576], [2, B, 128]) in one
call, and each row's output is bitwise equal to that row run alone (tests/gateway/test_vad_batch.py), which is
what lets gateway.vad.batcher share one call among sessions.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

SAMPLE_RATE_HZ = 16000
WINDOW_SAMPLES = 512  # 32 ms at 16 kHz, the only window size the 16 kHz model accepts
CONTEXT_SAMPLES = 64  # v5/v6 models see the tail of the previous window in front of each window
STATE_SHAPE = (2, 1, 128)
# The package's 16 kHz-only export: the same weights and, at 16 kHz, bitwise the same outputs and states as
# `silero_vad.onnx` (which carries an 8 kHz branch behind an If node), about a tenth faster per window (P10).
MODEL_FILE = "silero_vad_16k_op15.onnx"


def default_model_path() -> Path:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the silero_vad package is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"silero VAD model not found at {path}")
    return path


@dataclass(slots=True)
class VadState:
    """One session's recurrent state and window context; owned by that session's actor only."""
    rnn: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, np.float32))  # [2, 1, 128]
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT_SAMPLES, np.float32))  # [64]

    def reset(self) -> None:
        self.rnn[...] = 0.0
        self.context[...] = 0.0


class SileroVad:
    """Process-wide model. A window costs about 0.25 ms alone on one core, under 0.1 ms in a batch of 64; the
    served path batches (gateway.vad.batcher), `window_probability` / `probabilities` are the one-stream path."""

    def __init__(self, path: Path | str | None = None, *, intra_op_threads: int = 1) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3  # the file carries unused initialisers; their load warnings are noise
        self.path = Path(path) if path is not None else default_model_path()
        self._session = ort.InferenceSession(str(self.path), sess_options=opts,
                                             providers=["CPUExecutionProvider"])
        names = {i.name for i in self._session.get_inputs()}
        if names != {"input", "state", "sr"}:
            raise ValueError(f"{self.path.name}: expected inputs input/state/sr, got {sorted(names)}")
        self._sr = np.array(SAMPLE_RATE_HZ, dtype=np.int64)

    @staticmethod
    def new_state() -> VadState:
        return VadState()

    def run(self, x: np.ndarray, rnn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """B streams one window each: x [B, 576] (context + window), rnn [2, B, 128] -> probs [B], rnn [2, B, 128]."""
        prob, rnn_out = self._session.run(None, {"input": x, "state": rnn, "sr": self._sr})
        return np.asarray(prob, np.float32)[:, 0], np.asarray(rnn_out, np.float32)

    def window_probability(self, state: VadState, window: np.ndarray) -> float:
        """One 512-sample window of 16 kHz float audio in [-1, 1]; advances `state`."""
        if window.shape != (WINDOW_SAMPLES,):
            raise ValueError(f"window must be [{WINDOW_SAMPLES}], got {list(window.shape)}")
        x = np.concatenate([state.context, window.astype(np.float32, copy=False)])[None, :]  # [1, 576]
        prob, state.rnn = self.run(x, state.rnn)  # [1], [2, 1, 128]
        state.context = x[0, -CONTEXT_SAMPLES:].copy()  # [64]
        return float(prob[0])

    def probabilities(self, state: VadState, samples: np.ndarray) -> np.ndarray:
        """Whole windows of `samples` ([n * 512] float32) in order -> [n] probabilities."""
        n = len(samples) // WINDOW_SAMPLES
        out = np.empty(n, np.float32)
        for k in range(n):
            out[k] = self.window_probability(state, samples[k * WINDOW_SAMPLES:(k + 1) * WINDOW_SAMPLES])
        return out
