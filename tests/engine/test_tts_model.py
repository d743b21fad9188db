"""TTSModel backbone and conditioning against transformers' LlamaModel on the same random weights."""

from __future__ import annotations

import pytest
import torch

from engine.model.tts import TTSKVCache, TTSModel
from tests.engine.test_tts_helpers import hf_backbone, offline_condition, tiny_cfg, tiny_model

ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def model() -> TTSModel:
    return tiny_model()


def test_state_dict_keys_follow_checkpoint(model: TTSModel) -> None:
    c, sd = model.cfg, model.state_dict()
    expected = {"emb_text.weight": (c.num_text_tokens, c.hidden_size),
                "emb_code.0.weight": (c.num_audio_tokens, c.hidden_size),
                "head_code.0.weight": (c.num_audio_tokens, c.hidden_size),
                "projector_semantic.linear1.weight": (c.hidden_size, c.llm_dim),
                "projector_semantic.linear1.bias": (c.hidden_size,),
                "projector_semantic.linear2.weight": (c.hidden_size, c.hidden_size),
                "projector_semantic.linear2.bias": (c.hidden_size,),
                "model.norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("q", "k", "v", "o"):
            expected[p + f"self_attn.{name}_proj.weight"] = (c.hidden_size, c.hidden_size)
        expected[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        expected[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        expected[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        expected[p + "input_layernorm.weight"] = (c.hidden_size,)
        expected[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected


def _hf_full(model: TTSModel, embeds: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_backbone(model)(inputs_embeds=embeds[None]).last_hidden_state[0]


def test_full_forward_matches_hf(model: TTSModel) -> None:
    embeds = torch.randn(23, 64, generator=torch.Generator().manual_seed(1))
    kv = TTSKVCache.allocate(model.cfg, 1, 64, dtype=torch.float32)
    with torch.no_grad():
        ours = model(embeds[None], torch.arange(23)[None], torch.tensor([0]), kv)[0]
    torch.testing.assert_close(ours, _hf_full(model, embeds), atol=ATOL, rtol=RTOL)


def test_incremental_over_retained_kv_matches_full(model: TTSModel) -> None:
    embeds = torch.randn(30, 64, generator=torch.Generator().manual_seed(2))
    kv = TTSKVCache.allocate(model.cfg, 3, 64, dtype=torch.float32)
    outs, start = [], 0
    with torch.no_grad():
        for size in (7, 1, 1, 9, 1, 11):  # condition rows then single codes, as a turn does
            chunk = embeds[start:start + size]
            pos = torch.arange(start, start + size)[None]
            outs.append(model(chunk[None], pos, torch.tensor([2]), kv, kv_limit=32)[0])
            start += size
    torch.testing.assert_close(torch.cat(outs), _hf_full(model, embeds), atol=ATOL, rtol=RTOL)


def test_ragged_batch_rows_match_hf(model: TTSModel) -> None:
    """Two sessions in one padded forward, different slots, lengths and positions."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(12, 64, generator=g), torch.randn(9, 64, generator=g)
    kv = TTSKVCache.allocate(model.cfg, 2, 32, dtype=torch.float32)
    with torch.no_grad():
        model(b[:4][None], torch.arange(4)[None], torch.tensor([1]), kv)  # session b's earlier rows
        x = torch.zeros(2, 12, 64)
        x[0], x[1, :5] = a, b[4:]
        pos = torch.stack([torch.arange(12), torch.arange(4, 16)])
        valid = torch.arange(12)[None] < torch.tensor([[12], [5]])
        out = model(x, pos, torch.tensor([0, 1]), kv, valid=valid)
    torch.testing.assert_close(out[0], _hf_full(model, a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1, :5], _hf_full(model, b)[4:], atol=ATOL, rtol=RTOL)


def test_condition_rows(model: TTSModel) -> None:
    ids = [5, 300, 17]
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        rows = model.condition(torch.tensor(ids), hidden)
        cond = torch.cat([rows, model.audio_bos_row()[None]])
    torch.testing.assert_close(cond, offline_condition(model, ids, hidden), atol=ATOL, rtol=RTOL)


def test_logits_are_fp32_even_in_bf16() -> None:
    model = TTSModel(tiny_cfg()).to(torch.bfloat16)
    model.reset_rope_()
    assert model.inv_freq.dtype == torch.float32
    assert model.logits(torch.zeros(2, 64, dtype=torch.bfloat16)).dtype == torch.float32


def test_fused_projections_keep_keys_values_and_outputs() -> None:
    """fuse_projections(): q/k/v and gate/up as one matmul each, with the same state_dict keys and values and the
    same forward as transformers; a dtype move and a later load_state_dict still reach the fused matmuls."""
    plain, fused = tiny_model(seed=5), tiny_model(seed=5).fuse_projections()
    assert fused.fused and not plain.fused
    assert fused.model.layers[0].self_attn.qkv_weight is not None
    assert set(fused.state_dict()) == set(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    embeds = torch.randn(23, 64, generator=torch.Generator().manual_seed(6))
    kv = TTSKVCache.allocate(fused.cfg, 1, 64, dtype=torch.float32)
    with torch.no_grad():
        out = fused(embeds[None], torch.arange(23)[None], torch.tensor([0]), kv)[0]
    torch.testing.assert_close(out, _hf_full(plain, embeds), atol=ATOL, rtol=RTOL)
    moved = fused.to(torch.float64)
    moved.load_state_dict(tiny_model(seed=7).to(torch.float64).state_dict())
    attn = moved.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == torch.float64
    assert torch.equal(attn.qkv_weight[: attn.q_proj.weight.shape[0]], attn.q_proj.weight)
    assert attn.qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()  # still one tensor: the load reached it


def test_the_tts_engine_fuses_by_default() -> None:
    from engine.stage1.config import TTSEngineConfig
    from engine.stage1.tts_engine import TTSEngine

    assert TTSEngine(tiny_model(), TTSEngineConfig(max_sessions=2, max_batch=2)).model.fused
    off = TTSEngineConfig(max_sessions=2, max_batch=2, fuse_projections=False)
    assert not TTSEngine(tiny_model(), off).model.fused
