"""Padded GEMM rows (`layers.linear`, `Qwen3LLM.pad_gemm_rows`, Stage0Config.gemm_min_rows): cuBLAS picks its
kernel by the row count, and on the H200 a row's logits alone differed from the same row among 2-64 others
until the rows were padded to 32 (bench/RESULTS.md stop 36). Here: the padding keeps the values and shapes, a
padded row's numbers do not depend on the other rows, and the engine applies the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import linear
from engine.stage0 import DecodeRules, Stage0Config, Stage0Engine
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer


def test_linear_pads_short_inputs_and_cuts_the_result_back() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1, 16, generator=gen), torch.randn(5, 16, generator=gen)
    out = linear(x, w, 32)
    assert out.shape == (3, 1, 5)
    torch.testing.assert_close(out, F.linear(x, w))
    big = torch.randn(40, 16, generator=gen)
    assert torch.equal(linear(big, w, 32), F.linear(big, w))  # enough rows: the plain GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_do_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    """With 32 rows padded, a row's logits and its dense decode hidden state are the same bits alone and among
    up to 31 others (each call is one 32-row GEMM, whatever the count)."""
    model = tiny_llm().to(dtype).pad_gemm_rows(32)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, model.cfg.hidden_size, generator=gen).to(dtype)
    alone = model.logits(hidden[:1])[0]
    for n in (2, 5, 16, 32):
        assert torch.equal(model.logits(hidden[:n])[0], alone), n
    assert model.min_rows == 32 and {layer.self_attn.min_rows for layer in model.model.layers} == {32}
    assert model.pad_gemm_rows(0).min_rows == 0


def test_engine_applies_gemm_min_rows() -> None:
    model = tiny_llm()
    Stage0Engine(model, tiny_tokenizer(), FakeFrontEnd(), lambda e: None, Stage0Config(max_sessions=2, gemm_min_rows=8),
                 DecodeRules())
    assert model.min_rows == 8 and {layer.mlp.min_rows for layer in model.model.layers} == {8}
    with pytest.raises(ValueError, match="gemm_min_rows"):
        Stage0Config(gemm_min_rows=-1)
