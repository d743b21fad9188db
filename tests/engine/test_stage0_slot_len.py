"""The KV slot's top attention span is a multiple of `span_align` (an odd span ran a decode step 2.4-3.6x slower
on the H200: bench/RESULTS.md, stop 24), and it still holds the window plus the largest unit."""

from __future__ import annotations

import pytest
import torch

from engine.config import LLMConfig
from engine.model.llm import SlotKVCache
from engine.stage0.config import DecodeRules, Stage0Config


@pytest.mark.parametrize("window", [8000, 8192, 4096, 1000])
def test_top_span_is_aligned_and_holds_the_window_and_a_unit(window: int) -> None:
    rules = DecodeRules()
    cfg = Stage0Config(window_high=window, window_low=window // 2)
    n = cfg.slot_len(rules)
    need = window + cfg.unit_max_positions(rules)
    assert (n - 1) % 64 == 0 and need <= n - 1 < need + 64


def test_the_h200_window_is_served_at_span_8384_not_8357() -> None:
    rules = DecodeRules()
    assert Stage0Config(window_high=8192, window_low=6144).slot_len(rules) == 8385
    assert Stage0Config(window_high=8192, window_low=6144, span_align=1).slot_len(rules) == 8358


def test_eviction_off_rounds_max_context_too() -> None:
    rules = DecodeRules()
    assert Stage0Config(eviction="off", max_context=40960).slot_len(rules) == 40961
    assert Stage0Config(eviction="off", max_context=300).slot_len(rules) == 321
    assert Stage0Config(eviction="off", max_context=300, span_align=1).slot_len(rules) == 301


def test_the_allocated_slot_reserves_the_aligned_span() -> None:
    cfg, rules = Stage0Config(window_high=100, window_low=50), DecodeRules()
    dims = LLMConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=100, max_position_embeddings=512,
                     rope_theta=1e6, rms_norm_eps=1e-6)
    kv = SlotKVCache.allocate(dims, 2, cfg.slot_len(rules), dtype=torch.bfloat16, device="meta")
    assert kv.reserved_pos % 64 == 0


def test_span_align_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        Stage0Config(span_align=0)
