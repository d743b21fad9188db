"""Row buckets of the Token2Wav graphs (buckets.py): a batch of n rows runs at the smallest bucket >= n,
padded with dummy rows. On CPU, with CUDA graph capture replaced by stand-ins that keep the static-buffer
semantics (test_token2wav_ragged.FakeGraph) or just run the function:
  - a real row's flow output and every cache it leaves are bit-identical with or without dummy rows (a
    row alone, B = 1, included), and a session's PCM is bit-identical alone among dummies or in the same
    bucket with other sessions (dummies never touch a session's state; the kernels are row-wise). Only
    HiFT's CPU convolutions pick another kernel for another batch size (1e-7, at most one int16 step:
    as between batch sizes before the buckets), so alone-unpadded vs padded is checked to that bound;
  - warm-up builds graphs exactly for the bucket set, and a live batch of every size 1..max_batch finds
    a built graph (no miss).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from engine.stage1.token2wav_engine import WARMUP_UNITS, Token2WavEngine, Token2WavEngineConfig
from engine.stage1.types import Fence
from engine.token2wav import graphs, ragged_graphs
from engine.token2wav.buckets import bucket_rows, row_buckets
from engine.token2wav.config import TINY_FLOW, StreamConfig
from engine.token2wav.pool import FlowPool, PoolConfig
from engine.token2wav.pooled import run_flow_pooled
from engine.token2wav.ragged_graphs import RaggedSolver
from engine.token2wav.stream import PendingCall, new_session
from engine.token2wav.voice import build_voice_cache
from tests.engine.test_token2wav_engine import models, per_unit  # noqa: F401 - the module-scoped fixture
from tests.engine.test_token2wav_ragged import FakeGraph, logical, random_call
from tests.engine.test_token2wav_stream import codes, make_voice

N_TS = 2
CPU = torch.device("cpu")
F0 = Fence(1, 0)


class _HiFTGraph:
    """Stands in for engine.cuda_graph.StaticGraph on CPU (HiFT batches): runs the function on the replay's inputs."""

    def __init__(self, fn: Any, inputs: tuple[torch.Tensor, ...], pool: object) -> None:
        self.fn = fn

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self.fn(*inputs)


def test_row_buckets() -> None:
    assert row_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert row_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert row_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert row_buckets(5) == (1, 2, 4, 5) and row_buckets(1) == (1,)
    for top in (1, 5, 32, 64, 100):
        buckets = row_buckets(top)
        for n in range(1, top + 1):   # the smallest bucket that holds n rows
            b = bucket_rows(n, buckets)
            assert b in buckets and b >= n and not any(n <= c < b for c in buckets)
    with pytest.raises(ValueError):
        row_buckets(0)


def padded_solver(t2w: Any, buckets: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> RaggedSolver:
    monkeypatch.setattr(ragged_graphs, "StaticGraph", FakeGraph)
    solver = RaggedSolver(t2w.flow.decoder.estimator, enabled=False, buckets=buckets)
    solver.enabled = True             # the static-buffer and padding plumbing of the GPU path, run on CPU
    return solver


def test_dummy_rows_change_no_real_row(models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Three sessions (P = 120, 24, 60 frames) run the same ragged calls in three pools: padded to bucket 4
    by one dummy row (A), beside a fourth real session in that row (B: its prompt and calls are the
    smallest, so no key dimension changes), and unpadded eagerly (C). A == B bit for bit (each mel and
    each slot's caches at the positions in use; a dummy, like a padded frame, writes only the unused
    column Tg − 1 of row 0's slot), A's idle slot and the voices' base caches are never written, and
    A == C within 1e-5 (B = 3 vs 4 may pick other CPU kernels)."""
    scfg = StreamConfig(n_timesteps=N_TS)
    voices = [build_voice_cache(models.flow, make_voice(10 + i, p), scfg) for i, p in enumerate([60, 12, 30, 5])]
    base = [[t.clone() for t in v.tensors()] for v in voices]
    pools = [FlowPool(TINY_FLOW, scfg, PoolConfig(slots=4, max_prompt_frames=128), CPU, torch.float32) for _ in range(3)]
    runs = [[new_session(models, v, scfg, seed=i, slot=pool.acquire()) for i, v in enumerate(voices)] for pool in pools]
    solvers = [padded_solver(models, (4,), monkeypatch), padded_solver(models, (4,), monkeypatch), None]
    idle = [t.clone() for t in runs[0][3].slot.views()]
    rng, first, companion = random.Random(3), [True] * 4, 0
    for _ in range(8):
        calls = []
        for r in range(4):
            toks, last = random_call(rng, first[r], scfg.silence_code)
            if r == 3:    # the companion: a 5-code call, never the longest row (N would change)
                toks, last = toks[:5] + [0] * (5 - len(toks)), False
            calls.append([PendingCall(list(toks), last) for _ in pools])
            first[r] = last
        for k, (pool, sessions, solver) in enumerate(zip(pools, runs, solvers, strict=True)):
            longest = max(len(c[0].tokens) + 3 * c[0].last for c in calls[:3])
            rows = 4 if k == 1 and longest >= 5 else 3
            companion += rows == 4
            run_flow_pooled(models, pool, sessions[:rows], [c[k] for c in calls[:rows]], solver)
        for r in range(3):
            a, b, c = (call.mel for call in calls[r])
            assert torch.equal(a, b) and a.shape == c.shape
            torch.testing.assert_close(a, c, atol=1e-5, rtol=0)
            want, got = logical(runs[1][r].slot), logical(runs[0][r].slot)   # the positions in use, in order
            assert all(torch.equal(got[k], want[k]) for k in want)
            if calls[r][0].last:
                for sessions in runs:
                    sessions[r].reset_exec()
    assert companion >= 6 and all(torch.equal(x, y) for x, y in zip(idle, runs[0][3].slot.views(), strict=True))
    for before, v in zip(base, voices, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(before, v.tensors(), strict=True))
    assert {k[2][0] for k in solvers[0].graphs} == {4}   # the solve ran at the bucket only


def _engine(t2w: Any, max_batch: int, monkeypatch: pytest.MonkeyPatch, graph: type = FakeGraph) -> Token2WavEngine:
    monkeypatch.setattr(ragged_graphs, "StaticGraph", graph)
    monkeypatch.setattr(graphs, "StaticGraph", _HiFTGraph)
    eng = Token2WavEngine(t2w, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), max_batch=max_batch,
                                                     max_graphs=1000))
    eng.add_voice("a", make_voice(1))
    eng.solver.enabled = eng.graphs.enabled = True   # bucketed flow and HiFT batches, on CPU
    return eng


def _speak(eng: Token2WavEngine, sids: list[str], units: int = 3) -> list:
    for i, sid in enumerate(sids):
        eng.open(sid, F0, "a", seed=i)
    for u in range(units):
        for sid in sids:
            eng.submit(sid, F0, u, codes(100 * u + int(sid[1:]), 25), end_of_turn=u == units - 1)
    chunks = []
    while eng.pending():
        chunks += eng.step()
    return chunks


def test_session_pcm_alone_equals_padded_bucket(models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """s0 alone among 3 dummy rows and s0 beside s1, s2 (+ 1 dummy), bucket 4 in the flow and in HiFT: the
    same PCM, bit for bit. s0 alone at bucket 1 (no dummy): within one int16 step (HiFT kernels, above)."""
    runs = {}
    for name, sids, buckets in (("alone", ["s0"], (1, 2, 4)), ("padded", ["s0"], (4,)),
                                ("together", ["s0", "s1", "s2"], (1, 2, 4))):
        eng = _engine(models, 4, monkeypatch)
        eng.buckets = eng.solver.buckets = buckets
        runs[name] = per_unit(_speak(eng, sids), "s0")
        rows = {4} if name != "alone" else {1}
        assert {k[2][0] for k in eng.solver.graphs} == rows and {k[0][0] for k in eng.graphs.hift_graphs} == rows
    assert sorted(runs["alone"]) == sorted(runs["padded"]) == sorted(runs["together"]) == [0, 1, 2]
    for u in runs["alone"]:
        assert runs["padded"][u].any() and np.array_equal(runs["padded"][u], runs["together"][u]), u
        assert np.abs(runs["alone"][u].astype(np.int32) - runs["padded"][u]).max() <= 1, u


class _KeyGraph:
    """Records nothing, runs the function: the warm-up's enumeration is what is under test."""

    def __init__(self, fn: Any, inputs: tuple[torch.Tensor, ...], pool: object, shared: int | None) -> None:
        self.fn = fn

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self.fn(*inputs)


def test_warm_up_builds_the_buckets_and_every_batch_size_finds_one(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the fixture
    eng = _engine(models, 5, monkeypatch, _KeyGraph)
    eng.warm_up("a")
    assert eng.warm_sizes() == (5, 4, 2, 1)
    built = {"solve": {k[2][0] for k in eng.solver.graphs}, "encode": {k[0][0] for k in eng.solver.enc_graphs},
             "hift": {k[0][0] for k in eng.graphs.hift_graphs}}
    assert built == dict.fromkeys(built, set(row_buckets(5)))
    rng = np.random.default_rng(1)
    for n in range(1, 6):   # a live turn of n sessions, like the warm-up's: every batch maps to a built key
        fence = Fence(2, 0)
        for i in range(n):
            eng.open(f"t{i}", fence, "a", seed=i)
        for unit in range(WARMUP_UNITS):
            for i in range(n):
                eng.submit(f"t{i}", fence, unit, rng.integers(0, TINY_FLOW.vocab_size, 25).tolist(),
                           end_of_turn=unit == WARMUP_UNITS - 1)
        while eng.pending():
            eng.step()
        for i in range(n):
            eng.close(f"t{i}", fence)
    assert eng.misses.counts() == {}


def test_warm_up_covers_a_turn_whose_units_arrive_one_at_a_time(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the fixture
    """Served, a turn's codes arrive a unit at a time with the engine idle between them, not queued for the whole
    turn as in the warm-up turns: the calls that pattern makes find graphs built at warm-up."""
    eng = _engine(models, 2, monkeypatch, _KeyGraph)
    eng.warm_up("a")
    for n in (1, 2):
        _paced_turn(eng, Fence(3, n), n, [25] * (WARMUP_UNITS + 2))
    assert eng.misses.counts() == {}


@pytest.mark.parametrize("plan", [[19, 25, 25], [25, 25, 17], [4, 9], [25], [25, 9], [25] * 6 + [3], [25, 1]])
def test_warm_up_covers_every_shape_of_a_served_turn(
        models: Any, monkeypatch: pytest.MonkeyPatch, plan: list[int]) -> None:  # noqa: F811 - the fixture
    """A served turn has any number of units and may start or end with any number of codes, unlike the uniform
    warm-up turns. Every shape such a turn meets was built at warm-up: the vocoder's (first and last call
    lengths, stop 26) and the flow's encode and solve (fixed widths with graphs, pooled.py; on the H200 a
    2-call turn's last call and a deeper steady call ran eager mid-load at 32 sessions, stop 30)."""
    eng = _engine(models, 2, monkeypatch, _KeyGraph)
    eng.warm_up("a")
    for n in (1, 2):
        _paced_turn(eng, Fence(4, n), n, plan)
    assert eng.misses.counts() == {}


def test_warm_up_covers_sessions_at_different_depths_of_their_turns(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the fixture
    """One batch holds a session deep in its turn beside one at its first or last call: still built shapes."""
    eng = _engine(models, 4, monkeypatch, _KeyGraph)
    eng.warm_up("a")
    rng, fence = np.random.default_rng(7), Fence(5, 0)
    plans = {"d0": [25] * 5 + [6], "d1": [9], "d2": [25, 25, 13], "d3": [25, 2]}
    for i, sid in enumerate(plans):
        eng.open(sid, fence, "a", seed=i)
    for unit in range(6):
        for i, (sid, plan) in enumerate(plans.items()):
            at = unit - i   # session i starts i units late
            if 0 <= at < len(plan):
                eng.submit(sid, fence, at, rng.integers(0, TINY_FLOW.vocab_size, plan[at]).tolist(),
                           end_of_turn=at == len(plan) - 1)
        while eng.pending():
            eng.step()
    assert eng.misses.counts() == {}


def _paced_turn(eng: Token2WavEngine, fence: Fence, sessions: int, codes_per_unit: list[int]) -> None:
    """One turn of `sessions` sessions as served: each unit's codes submitted, then the engine run until idle."""
    rng = np.random.default_rng(len(codes_per_unit) * 100 + codes_per_unit[0])
    for i in range(sessions):
        eng.open(f"p{i}", fence, "a", seed=i)
    for unit, n in enumerate(codes_per_unit):
        for i in range(sessions):
            eng.submit(f"p{i}", fence, unit, rng.integers(0, TINY_FLOW.vocab_size, n).tolist(),
                       end_of_turn=unit == len(codes_per_unit) - 1)
        while eng.pending():
            eng.step()
    for i in range(sessions):
        eng.close(f"p{i}", fence)
