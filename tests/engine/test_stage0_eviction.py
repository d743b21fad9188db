"""`basic` KV window eviction with RoPE re-rotation (model.md §7.4, invariants I7 and I12)."""

from __future__ import annotations

import pytest
import torch

from engine.model.llm import SlotKVCache
from engine.stage0 import DecodeRules, Fence
from tests.engine.test_stage0_engine import fed_sequence, make_engine, params
from tests.engine.test_stage0_helpers import tiny_llm, unit_pcm

ATOL = 1e-5
HIGH, LOW = 120, 90


def evicted_session(layers: int, merge: bool = True):
    engine, events = make_engine(tiny_llm(seed=1, layers=layers), sessions=2,
                                 rules=DecodeRules(force_listen_count=1), window_high=HIGH, window_low=LOW,
                                 merge_unit_close=merge)
    engine.open("b", Fence(1, 0), params=params(9))  # a neighbour in slot 0 must stay untouched
    engine.open("a", Fence(1, 0), params=params(4))
    engine.append("b", Fence(1, 0, seq=0), unit_pcm(9, 0))
    engine.run_until_idle()
    used = engine.runner.kv.reserved_pos  # idle dense decode rows may write the reserved last position
    neighbour = [t[engine.session("b").slot, :, :used].clone() for t in engine.runner.kv.k]
    lengths = []
    for k in range(10):
        engine.append("a", Fence(1, 0, seq=k), unit_pcm(4, k))
        engine.run_until_idle()
        s = engine.session("a")
        lengths.append(s.owed_len)  # with `merge_unit_close` the last close is owed, not yet in the KV
        assert s.owed_len <= HIGH and sum(r.span for r in s.ledger) == s.owed_len - s.prefix_len  # I12
    s = engine.session("a")
    assert s.ledger[0].index > 0, "no eviction happened"
    assert max(lengths) <= HIGH and min(lengths[3:]) >= s.prefix_len
    for t, before in zip(engine.runner.kv.k, neighbour, strict=True):
        assert torch.equal(t[engine.session("b").slot, :, :used], before)
    seq, _ = fed_sequence(engine, "a", events, units={r.index for r in s.ledger})
    assert seq.shape[0] == s.owed_len
    return engine, s, seq


def fresh(engine, seq: torch.Tensor) -> tuple[SlotKVCache, torch.Tensor]:
    kv = SlotKVCache.allocate(engine.model.cfg, 1, seq.shape[0] + 1, dtype=torch.float32)
    with torch.no_grad():
        h = engine.model(seq[None], torch.arange(seq.shape[0])[None], torch.tensor([0]), kv)[0]
    return kv, h


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("layers", [2])
def test_layer0_kv_equals_recompute_on_retained_tokens(layers: int, merge: bool) -> None:
    engine, s, seq = evicted_session(layers, merge)
    kv, _ = fresh(engine, seq)
    n = s.cached_len
    torch.testing.assert_close(engine.runner.kv.k[0][s.slot, :, :n], kv.k[0][0, :, :n], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(engine.runner.kv.v[0][s.slot, :, :n], kv.v[0][0, :, :n], atol=ATOL, rtol=ATOL)


def test_one_layer_next_logits_equal_recompute() -> None:
    engine, s, seq = evicted_session(1)
    x = torch.randn(1, engine.model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    kv, _ = fresh(engine, seq)
    n = s.cached_len
    with torch.no_grad():
        ref = engine.model(x[None], torch.tensor([[n]]), torch.tensor([0]), kv)[0, 0]
        got = engine.model(x[None], torch.tensor([[n]]), torch.tensor([s.slot]), engine.runner.kv)[0, 0]
    torch.testing.assert_close(engine.model.logits(got), engine.model.logits(ref), atol=ATOL, rtol=ATOL)


def test_unrotating_recovers_keys_at_old_positions() -> None:
    """I7 (c): rotating back by the shift restores what the key was before eviction."""
    model = tiny_llm(layers=1)
    keys = torch.randn(2, 7, model.cfg.head_dim)
    moved = model.rotate_keys(keys, 37)
    torch.testing.assert_close(model.rotate_keys(moved, -37), keys, atol=ATOL, rtol=ATOL)
