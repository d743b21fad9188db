"""Ragged flow batches over the slot pool == the solo per-session path (issue 4, §6.8).

The oracle is `run_flow_batch` on one session with its own FlowCache tensors (itself checked against
the Step-Audio2 reference in test_token2wav_stream.py). Eight sessions with different prompt lengths
(P below and above the 100 kept frames, so both trim regimes run) issue calls of 28, 15, 8 and 5
codes and last calls of 1–15 codes; each round a random subset runs as ONE ragged batch, turns end
and restart, and some turns are cancelled midway. Every call's mel and every logical cache must match
the solo path within 1e-5.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.cuda_graph import StaticGraph
from engine.token2wav import ragged_graphs
from engine.token2wav.assets import TINY_HIFT, Token2WavModels, build_tiny_modules
from engine.token2wav.config import TINY_FLOW, StreamConfig
from engine.token2wav.pool import FlowPool, PoolConfig, PoolError
from engine.token2wav.pooled import run_flow_pooled
from engine.token2wav.ragged_graphs import RaggedSolver
from engine.token2wav.stream import PendingCall, new_session, run_flow_batch
from engine.token2wav.voice import build_voice_cache
from tests.engine.test_token2wav_refutil import enlarge_flow_
from tests.engine.test_token2wav_stream import make_voice

N_TS = 2
TOL = 1e-5
PROMPT_TOKENS = [5, 8, 12, 20, 30, 45, 55, 60]      # P = 10 … 120 mel frames
CALL_SIZES = [28, 15, 8, 5]
LAST_SIZES = [1, 3, 7, 15]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models() -> Token2WavModels:
    flow, hift = build_tiny_modules(seed=0)
    enlarge_flow_(flow)
    return Token2WavModels(flow.eval(), hift.eval(), TINY_FLOW, TINY_HIFT, "A")


def logical(slot) -> dict[str, torch.Tensor]:
    """A slot's caches in the solo layout's order (estimator newest first, conformer oldest first)."""
    p, i = slot.pool, slot.slot
    return {"est": p.est_att[i][..., torch.from_numpy(slot.est), :], "est_cnn": p.est_cnn[i],
            "tok": p.tok_att[i][:, :, torch.from_numpy(slot.tok)], "mel": p.mel_att[i][:, :, torch.from_numpy(slot.mel)],
            "enc_cnn": p.enc_cnn[i]}


def solo_view(cache, n_tok: int) -> dict[str, torch.Tensor]:
    att = cache.conformer_att
    return {"est": cache.estimator_att, "est_cnn": cache.estimator_cnn, "tok": att[:n_tok, 0, :, : att.shape[3] // 2],
            "mel": att[n_tok:, 0], "enc_cnn": cache.conformer_cnn[0]}


def check_caches(pooled, solo) -> None:
    want, got = solo_view(solo.flow_cache, TINY_FLOW.enc_blocks), logical(pooled.slot)
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], atol=TOL, rtol=TOL)   # K/V reach |x| ≈ 20


def random_call(rng: random.Random, first: bool, silence: int) -> tuple[list[int], bool]:
    last = not first and rng.random() < 0.2
    n = rng.choice(LAST_SIZES if last else CALL_SIZES)
    toks = [rng.randrange(TINY_FLOW.vocab_size) for _ in range(n)]
    if first:                                        # a turn's first call starts with the silence prefix
        toks[:3] = [silence] * 3
    return toks, last


class FakeGraph(StaticGraph):
    """CPU stand-in for a captured graph with the same static-buffer semantics: the static inputs are the
    solver's (views of storage shared by every graph of a kind, the K/V window of the solve read in place),
    replay recomputes from them into the SAME output tensors, which the solver also shares per kind, so a
    caller that keeps an output past the next replay of any graph would see it change."""

    replays = 0

    def __init__(self, fn, inputs, pool, shared) -> None:
        self.fn, self.graph, self.in_place = fn, self, shared
        self.inputs = inputs
        self.outputs = fn(*self.inputs)

    def replay(self) -> None:
        FakeGraph.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.inputs), strict=True):
            out.copy_(new)


def graph_solver(models, monkeypatch) -> RaggedSolver:
    monkeypatch.setattr(ragged_graphs, "StaticGraph", FakeGraph)
    solver = RaggedSolver(models.flow.decoder.estimator, enabled=False)
    solver.enabled = True             # the static-buffer plumbing of the GPU path, run on CPU
    return solver


@pytest.mark.parametrize("trim, graphs", [("v0.1.2", False), ("v1.0.7", False), ("v0.1.2", True)])
def test_ragged_batches_equal_solo(models, trim, graphs, monkeypatch):
    scfg = StreamConfig(n_timesteps=N_TS, conformer_cache_trim=trim,
                        flow_cache_trim="reference" if trim == "v0.1.2" else "prompt_plus_recent")
    pool = FlowPool(TINY_FLOW, scfg, PoolConfig(slots=10, max_prompt_frames=128), CPU, torch.float32)
    voices = [build_voice_cache(models.flow, make_voice(10 + i, p), scfg) for i, p in enumerate(PROMPT_TOKENS)]
    base = [[t.clone() for t in v.tensors()] for v in voices]
    solo = [new_session(models, v, scfg, seed=i) for i, v in enumerate(voices)]
    pooled = [new_session(models, v, scfg, seed=i, slot=pool.acquire()) for i, v in enumerate(voices)]
    solver = graph_solver(models, monkeypatch) if graphs else None
    rng = random.Random(trim)
    first = [True] * len(voices)
    n_rows, n_last, batch_sizes = 0, 0, set()
    for _ in range(14):
        rows = sorted(rng.sample(range(len(voices)), rng.randint(2, len(voices))))
        batch_sizes.add(len(rows))
        work = []
        for r in rows:
            toks, last = random_call(rng, first[r], scfg.silence_code)
            work.append((r, PendingCall(toks, last), PendingCall(list(toks), last)))
            first[r] = last
        run_flow_pooled(models, pool, [pooled[r] for r, _, _ in work], [c for _, _, c in work], solver)
        for r, c_solo, c_pool in work:
            run_flow_batch(models, [solo[r]], [c_solo])
            assert c_pool.mel.shape == c_solo.mel.shape
            torch.testing.assert_close(c_pool.mel, c_solo.mel, atol=TOL, rtol=0)
            n_rows += 1
            if c_solo.last:                          # end of turn: both start the next turn from the base
                n_last += 1
                solo[r].reset_exec()
                pooled[r].reset_exec()
            check_caches(pooled[r], solo[r])
        for r in rows:                               # cancel: a turn reset midway
            if not first[r] and rng.random() < 0.1:
                solo[r].reset_turn()
                pooled[r].reset_turn()
                first[r] = True
                check_caches(pooled[r], solo[r])
    assert n_rows > 60 and n_last >= 3 and len(batch_sizes) > 2
    assert max(s.flow_cache.estimator_len for s in solo) > 100     # some rows ran trimmed
    if solver is not None:
        assert solver.graphs and solver.enc_graphs and FakeGraph.replays > 0
    for before, v in zip(base, voices, strict=True):                # base caches are never written
        assert all(torch.equal(x, y) for x, y in zip(before, v.tensors(), strict=True))


def test_pool_slots_are_owned(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    pool = FlowPool(TINY_FLOW, scfg, PoolConfig(slots=3, max_prompt_frames=32), CPU, torch.float32)
    slots = [pool.acquire() for _ in range(3)]
    with pytest.raises(PoolError):
        pool.acquire()
    ranges = [[(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in s.views()] for s in slots]
    assert all(t.is_contiguous() for s in slots for t in s.views())
    flat = sorted(r for rs in ranges for r in rs)
    assert all(a[1] <= b[0] for a, b in zip(flat, flat[1:], strict=False))          # no two views overlap
    voice = build_voice_cache(models.flow, make_voice(3, 8), scfg)
    with pytest.raises(PoolError):
        FlowPool(TINY_FLOW, scfg, PoolConfig(slots=1, max_prompt_frames=8), CPU, torch.float32).acquire().load(voice)
    # a session writing its slot leaves the others' slots untouched
    a, b = (new_session(models, voice, scfg, seed=0, slot=s) for s in slots[:2])
    before = [t.clone() for t in b.slot.views()]
    a.stream([scfg.silence_code] * 3 + list(range(25)), last=False)
    assert all(torch.equal(x, y) for x, y in zip(before, b.slot.views(), strict=True))
    assert a.slot.est.shape[0] > b.slot.est.shape[0]
    pool.release(slots[2])
    with pytest.raises(PoolError):
        pool.release(slots[2])
    again = pool.acquire()
    assert again.slot == 2 and np.array_equal(again.est, np.zeros(0))


def test_fp16_flow_pool_follows_model_dtype():
    """The pool takes the flow's dtype; fp16 ragged rows match fp16 solo rows to a few fp16 ulps."""
    flow, hift = build_tiny_modules(seed=0)
    models = Token2WavModels(flow.to(torch.float16).eval(), hift.eval(), TINY_FLOW, TINY_HIFT, "A")
    scfg = StreamConfig(n_timesteps=N_TS)
    pool = FlowPool(TINY_FLOW, scfg, PoolConfig(slots=2, max_prompt_frames=64), CPU, torch.float16)
    voices = [build_voice_cache(models.flow, make_voice(1, p), scfg) for p in (8, 20)]
    solo = [new_session(models, v, scfg, seed=3) for v in voices]
    pooled = [new_session(models, v, scfg, seed=3, slot=pool.acquire()) for v in voices]
    rng = random.Random(0)
    for k in range(3):
        calls = [random_call(rng, k == 0, scfg.silence_code) for _ in voices]
        want = [PendingCall(list(t), last) for t, last in calls]
        got = [PendingCall(list(t), last) for t, last in calls]
        run_flow_pooled(models, pool, pooled, got)
        for s, c in zip(solo, want, strict=True):
            run_flow_batch(models, [s], [c])
        for w, g in zip(want, got, strict=True):
            assert g.mel.dtype == torch.float16 and g.mel.shape == w.mel.shape
            torch.testing.assert_close(g.mel.float(), w.mel.float(), atol=8e-3, rtol=4e-3)
        if any(last for _, last in calls):
            break
