"""Sampling (model.md §3.5) against a plain-Python re-statement of the spec, and the I9/I11 properties."""

from __future__ import annotations

import math

import pytest
import torch

from engine.stage0.sampling import SamplerIds, SamplingBatch, SamplingParams, UniformStream, draw, sample
from tests.engine.test_stage0_helpers import tiny_ids

V = 320


def _ids() -> SamplerIds:
    s = tiny_ids()
    return SamplerIds(chunk_eos=s.chunk_eos, turn_eos=s.turn_eos, listen_bias=s.listen,
                      masked=(s.tts_pad, *s.bad_token_ids, s.chunk_eos))


def _draw_ref(p: list[float], u: float) -> int:
    cs, acc = [], torch.tensor(0.0)
    for x in p:
        acc = acc + torch.tensor(x, dtype=torch.float32)
        cs.append(acc)
    thr = torch.tensor(u, dtype=torch.float64).float() * cs[-1]
    for i, c in enumerate(cs):
        if c > thr:
            return i
    return max(i for i, x in enumerate(p) if x > 0)


def _softmax(x: list[float]) -> list[float]:
    return torch.softmax(torch.tensor(x, dtype=torch.float32), 0).tolist()


def _sample_ref(logits: list[float], p: SamplingParams, hist: list[int], u: list[float], ids: SamplerIds):
    """Returns (token, draws, appended) following §3.5 line by line."""
    a = max(range(V), key=lambda i: (logits[i], -i)) if p.greedy else _draw_ref(_softmax(logits), u[0])
    if a == ids.chunk_eos:
        return a, 0 if p.greedy else 1, False
    y = list(logits)
    for i in ids.masked:
        y[i] = -math.inf
    for i in set(hist[-p.repetition_window:]):
        y[i] = y[i] / p.repetition_penalty
    te = y[ids.turn_eos]
    y[ids.turn_eos] = te / p.turn_eos_length_penalty if te > 0 else te * p.turn_eos_length_penalty
    y[ids.listen_bias] *= p.listen_prob_scale
    if p.listen_top_k and sum(v > y[ids.listen_bias] for v in y) < p.listen_top_k:
        return ids.listen_bias, 0 if p.greedy else 1, False
    if p.greedy:
        return max(range(V), key=lambda i: (y[i], -i)), 0, True
    z = [torch.tensor(v / p.temperature, dtype=torch.float32).item() for v in y]
    kth = sorted(z, reverse=True)[min(p.top_k, V) - 1]
    z = [v if v >= kth else -math.inf for v in z]
    order = sorted(range(V), key=lambda i: (-z[i], i))
    probs = _softmax([z[i] for i in order])
    keep, mass = set(), 0.0
    for rank, i in enumerate(order):
        if mass <= p.top_p:
            keep.add(i)
        mass += probs[rank]
    z = [v if i in keep else -math.inf for i, v in enumerate(z)]
    return _draw_ref(_softmax(z), u[1]), 2, True


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(V, generator=g) * 3).tolist()
    hist = torch.randint(0, V, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
    return logits, hist


PARAMS = [SamplingParams(), SamplingParams(greedy=True), SamplingParams(temperature=1.3, top_k=5, top_p=0.5),
          SamplingParams(listen_top_k=300), SamplingParams(top_k=1000, top_p=1.0, repetition_penalty=1.3)]


@pytest.mark.parametrize("pi", range(len(PARAMS)))
def test_sample_matches_reference_and_is_batch_independent(pi: int) -> None:
    ids, rows = _ids(), []
    for seed in range(12):
        logits, hist = _case(seed)
        if seed % 3 == 0:  # make Step A hit `<|chunk_eos|>` sometimes, and negative logits in the history
            logits[ids.chunk_eos] = 9.0
        rows.append((logits, hist, UniformStream(seed).peek(2)))
    p = PARAMS[pi]
    batch = SamplingBatch.build([p] * len(rows), [r[1] for r in rows], [r[2] for r in rows], V, "cpu")
    tok, draws, app, exact = sample(torch.tensor([r[0] for r in rows]), batch, ids)
    full = sample(torch.tensor([r[0] for r in rows]), batch, ids, candidates=None)
    tok = torch.where(exact, tok, full[0])  # what the engine does with a row whose top-k passed the candidates
    assert exact.all() == (p.greedy or p.top_k <= 64) and full[3].all()
    for i, (logits, hist, u) in enumerate(rows):
        assert (tok[i].item(), draws[i].item(), app[i].item()) == _sample_ref(logits, p, hist, u, ids)
        solo = SamplingBatch.build([p], [hist], [u], V, "cpu")
        got, _, _, fit = sample(torch.tensor([logits]), solo, ids)
        assert (got if fit.item() else sample(torch.tensor([logits]), solo, ids, None)[0]).item() == tok[i].item()


def test_masked_ids_never_sampled_and_penalty_sign_quirk() -> None:
    ids = _ids()
    logits = torch.full((1, V), -5.0)
    for i in ids.masked[:-1]:
        logits[0, i] = 50.0
    logits[0, 100] = -1.0  # in the history: divided by the penalty, so it rises (Q2)
    logits[0, 101] = -1.02
    p = SamplingParams(greedy=True, repetition_penalty=1.05)
    batch = SamplingBatch.build([p], [[100]], [[0.5, 0.5]], V, "cpu")
    assert sample(logits, batch, ids)[0].item() == 100
    batch = SamplingBatch.build([p], [[101]], [[0.5, 0.5]], V, "cpu")
    assert sample(logits, batch, ids)[0].item() == 101


def test_draw_primitive_fallback_and_uniform_stream() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    assert draw(p, torch.tensor([0.0], dtype=torch.float64)).item() == 1
    assert draw(p, torch.tensor([1.0], dtype=torch.float64)).item() == 2  # nothing exceeds: last p > 0
    a, b = UniformStream(7), UniformStream(7)
    first = a.peek(2)
    a.consume(1)
    assert a.peek(1) == [first[1]]
    assert b.peek(1) == [first[0]]
    b.consume(1)
    assert b.peek(1) == [first[1]] and b.consumed == 1
