"""Warm before ready (issue 15), on CPU: what each engine's warm-up builds, and that a shape outside the
built set is counted and logged once. CUDA graph capture itself is replaced by a stand-in that records the
key (and, for Token2Wav, runs the function eagerly): the enumeration and the miss accounting are the code
under test; capture on a GPU is covered by the graph tests that run where one is lent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.loader import load_checkpoint
from engine.loader.checkpoint import TTS_COMPONENTS
from engine.stage1.config import TTSEngineConfig
from engine.stage1.runner import TTSRunner, _Graph
from engine.stage1.token2wav_engine import WARMUP_UNITS, Token2WavEngine, Token2WavEngineConfig
from engine.stage1.types import Fence
from engine.token2wav import ragged_graphs
from engine.token2wav.config import StreamConfig
from engine.warmup import GraphMisses, Progress
from model_repository.common.metrics import StageMetrics
from tests.engine.test_token2wav_engine import models  # noqa: F401 - the module-scoped fixture
from tests.engine.test_token2wav_stream import make_voice


def test_misses_count_after_warm_up_and_log_each_shape_once(caplog: pytest.LogCaptureFixture) -> None:
    misses = GraphMisses("tts")
    misses.record("step", (1, 256), "captured now")  # during warm-up: the plan, not a miss
    assert misses.counts() == {}
    misses.warm = True
    with caplog.at_level(logging.WARNING, logger="engine.warmup"):
        for _ in range(3):
            misses.record("step", (64, 256), "captured now")
        misses.record("prefill_rows", 80, "eager")
    assert misses.counts() == {"step": 3, "prefill_rows": 1}
    assert [r.getMessage().split(":")[1].strip().split(" shape")[0] for r in caplog.records] == ["step", "prefill_rows"]


def test_progress_lines() -> None:
    lines: list[str] = []
    progress = Progress("tts", 2, lines.append)
    progress.step("a")
    progress.step("b")
    progress.done()
    assert [line.split(" (")[0] for line in lines[:2]] == ["tts warm-up 1/2: a", "tts warm-up 2/2: b"]
    assert lines[2].startswith("tts warm-up done: 2 built in ")


# ---- TTS ---------------------------------------------------------------------------------------------

def _tts_runner(tiny_ckpt: Path, **cfg: Any) -> TTSRunner:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False,
                         components=TTS_COMPONENTS)
    runner = TTSRunner(ck.model.tts, TTSEngineConfig(**cfg), dtype=torch.float32)
    runner.use_graphs = True  # as on CUDA; `_capture` below stands in for the capture
    runner._capture = lambda key, fn, reset: runner._graphs.__setitem__(key, _Graph(None, None))  # type: ignore[method-assign, arg-type]
    return runner


def test_tts_warm_up_builds_every_graph_the_config_allows(tiny_ckpt: Path) -> None:
    runner = _tts_runner(tiny_ckpt, max_sessions=4, max_batch=4, max_turn_positions=1024)
    lines: list[str] = []
    runner.warm_up(lines.append)
    batches, kv_limits, rows = (1, 2, 4), (256, 512, 1024), (8, 16, 32, 64)
    want = {("step", b, k) for b in batches for k in kv_limits}
    want |= {("prefill", b, r, k) for b in batches for r in rows for k in kv_limits}
    assert set(runner._graphs) == want
    assert len(lines) == len(want) + 1 and lines[-1].startswith("tts warm-up done")
    # every shape run_unit can pick for <= max_batch sessions is built: no miss
    for b in range(1, 5):
        for needed in (1, 300, 700, 1024):
            runner._step_graph(runner.cfg.batch_bucket(b), runner.cfg.kv_bucket(needed))
    assert runner.misses.counts() == {}
    runner._step_graph(8, 256)  # a batch bucket above max_batch was never built
    runner._step_graph(8, 256)
    assert runner.misses.counts() == {"step": 1}  # captured on the first miss, found on the second


def test_tts_warm_up_is_a_no_op_without_graphs(tiny_ckpt: Path) -> None:
    runner = _tts_runner(tiny_ckpt, max_batch=2)
    runner.use_graphs = False
    runner.warm_up()
    assert runner._graphs == {} and runner.misses.warm


# ---- Token2Wav -------------------------------------------------------------------------------------------

class _EagerGraph:
    """Stands in for engine.cuda_graph.StaticGraph on CPU: records nothing, runs the function."""

    def __init__(self, fn: Any, inputs: tuple[torch.Tensor, ...], pool: object, shared: int | None) -> None:
        self.fn = fn

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self.fn(*inputs)


def _turn(eng: Token2WavEngine, sessions: int) -> None:
    rng = np.random.default_rng(7)
    fence = Fence(1, 0)
    for i in range(sessions):
        eng.open(f"s{i}", fence, "a", seed=i)
    for unit in range(WARMUP_UNITS):
        for i in range(sessions):
            eng.submit(f"s{i}", fence, unit, rng.integers(0, eng.models.flow_cfg.vocab_size, 25).tolist(),
                       end_of_turn=unit == WARMUP_UNITS - 1)
    while eng.pending():
        eng.step()
    for i in range(sessions):
        eng.close(f"s{i}", fence)


def test_token2wav_warm_up_runs_every_row_bucket_and_counts_later_misses(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the fixture
    monkeypatch.setattr(ragged_graphs, "StaticGraph", _EagerGraph)
    eng = Token2WavEngine(models, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=2), max_batch=5,
                                                        max_graphs=1000))
    eng.add_voice("a", make_voice(1))
    eng.solver.enabled = True
    lines: list[str] = []
    eng.warm_up("a", lines.append, warm_batch=3)  # row buckets 1 2 4 5: 3 rows pad to 4, so it runs 4, 2, 1
    assert [line.split(":")[0] for line in lines[:3]] == [f"token2wav warm-up {i}/3" for i in (1, 2, 3)]
    assert eng.misses.warm and eng.graph_count() > 0
    assert eng.sessions == {} and len(eng.pool._free) == eng.cfg.pool.slots  # warm-up sessions are gone
    for b in (1, 2, 3, 4):  # turns like the warm-up's find their graphs (3 rows: bucket 4)
        _turn(eng, b)
    assert eng.misses.counts() == {}
    built = eng.graph_count()
    _turn(eng, 5)  # a row bucket the warm-up did not run: counted, and run eager (never captured live)
    assert sum(eng.misses.counts().values()) > 0 and eng.graph_count() == built


def test_token2wav_warm_up_without_graphs_only_marks_warm(models: Any) -> None:  # noqa: F811 - the fixture
    eng = Token2WavEngine(models, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=2), max_batch=2))
    eng.add_voice("a", make_voice(1))
    eng.warm_up("a")
    assert eng.misses.warm and eng.graph_count() == 0 and eng.sessions == {}


# ---- the metric ------------------------------------------------------------------------------------------

class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def increment(self, n: int) -> None:
        self.value += n


class _Sink:
    def __init__(self) -> None:
        self.counters: dict[str, _Counter] = {}

    def miss_counter(self, kind: str) -> _Counter:
        return self.counters.setdefault(kind, _Counter())


def test_stage_metrics_publish_miss_deltas() -> None:
    sink, misses = _Sink(), GraphMisses("tts")
    metrics = StageMetrics("tts", histograms=lambda stage: sink)
    metrics.watch_misses(misses.counts)
    misses.warm = True
    misses.record("step", (8, 256), "captured now")
    metrics.flush()
    misses.record("step", (8, 512), "captured now")
    misses.record("prefill_rows", 70, "eager")
    metrics.flush()
    metrics.flush()
    assert {k: c.value for k, c in sink.counters.items()} == {"step": 2, "prefill_rows": 1}
