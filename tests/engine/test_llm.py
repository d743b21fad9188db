"""Qwen3LLM against transformers' Qwen3ForCausalLM on tiny random weights (model.md §9.2, §9.6 I5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import LLMConfig
from engine.model.llm import Qwen3LLM, SlotKVCache

transformers = pytest.importorskip("transformers")

TINY = LLMConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6)
ATOL = 1e-5


def _hf_config(cfg: LLMConfig) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, attention_bias=False,
        attn_implementation="eager")


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3LLM, transformers.Qwen3ForCausalLM]:
    gen = torch.Generator().manual_seed(0)
    ours = Qwen3LLM(TINY).eval()
    with torch.no_grad():
        for name, p in sorted(ours.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen) * 5)
    ref = transformers.Qwen3ForCausalLM(_hf_config(TINY)).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    return ours, ref


def _reference(ref: transformers.Qwen3ForCausalLM, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        hidden = ref.model(inputs_embeds=emb[None]).last_hidden_state[0]  # [N, H]
        return hidden, ref.lm_head(hidden)


def _feed(model: Qwen3LLM, kv: SlotKVCache, slot: int, emb: torch.Tensor, start: int) -> torch.Tensor:
    pos = torch.arange(start, start + emb.shape[0])[None]
    with torch.no_grad():
        return model(emb[None], pos, torch.tensor([slot]), kv)[0]


def test_state_dict_keys_match_checkpoint_layout(models: tuple) -> None:
    ours, _ = models
    keys = set(ours.state_dict())
    assert "model.layers.1.self_attn.q_norm.weight" in keys and "lm_head.weight" in keys
    assert not any("inv_freq" in k or "bias" in k for k in keys)
    assert len(keys) == 2 + 1 + TINY.num_hidden_layers * 11


def test_full_forward_matches_transformers(models: tuple) -> None:
    ours, ref = models
    emb = torch.randn(40, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    hidden_ref, logits_ref = _reference(ref, emb)
    kv = SlotKVCache.allocate(TINY, slots=2, max_len=64, dtype=torch.float32)
    hidden = _feed(ours, kv, 1, emb, 0)
    torch.testing.assert_close(hidden, hidden_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(ours.logits(hidden), logits_ref, atol=ATOL, rtol=ATOL)
    assert torch.equal(ours.embed(torch.tensor([3, 5])), ours.model.embed_tokens.weight[[3, 5]])


@pytest.mark.parametrize("segments", [[40], [17, 11, 1, 1, 2, 1, 7], [1] * 20 + [20], [5, 2, 13, 2, 18]])
def test_segmentation_equals_full_forward(models: tuple, segments: list[int]) -> None:
    """I5: prefix, unit prefills, single-token feeds and 2-token closes over retained KV."""
    ours, ref = models
    emb = torch.randn(sum(segments), TINY.hidden_size, generator=torch.Generator().manual_seed(2))
    hidden_ref, logits_ref = _reference(ref, emb)
    kv = SlotKVCache.allocate(TINY, slots=3, max_len=48, dtype=torch.float32)
    outs, start = [], 0
    for n in segments:
        outs.append(_feed(ours, kv, 2, emb[start:start + n], start))
        start += n
    hidden = torch.cat(outs)
    torch.testing.assert_close(hidden, hidden_ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(ours.logits(hidden), logits_ref, atol=ATOL, rtol=ATOL)


def test_batched_ragged_rows_equal_each_row_alone(models: tuple) -> None:
    ours, _ = models
    gen = torch.Generator().manual_seed(3)
    lengths, new = [5, 17, 0, 9], [3, 1, 11, 2]  # cached lengths and ragged new tokens per row
    slots = [3, 0, 2, 1]
    embs = [torch.randn(c + n, TINY.hidden_size, generator=gen) for c, n in zip(lengths, new, strict=True)]
    solo, batched = (SlotKVCache.allocate(TINY, slots=4, max_len=32, dtype=torch.float32) for _ in range(2))
    for kv in (solo, batched):
        for slot, c, e in zip(slots, lengths, embs, strict=True):
            if c:
                _feed(ours, kv, slot, e[:c], 0)
    expect = [_feed(ours, solo, s, e[c:], c) for s, c, e in zip(slots, lengths, embs, strict=True)]
    t = max(new)
    x = torch.zeros(len(new), t, TINY.hidden_size)
    pos = torch.zeros(len(new), t, dtype=torch.long)
    valid = torch.zeros(len(new), t, dtype=torch.bool)
    for i, (c, n, e) in enumerate(zip(lengths, new, embs, strict=True)):
        x[i, :n], pos[i, :n], valid[i, :n] = e[c:], torch.arange(c, c + n), True
    with torch.no_grad():
        out = ours(x, pos, torch.tensor(slots), batched, valid=valid, kv_limit=24)
    for i, n in enumerate(new):
        torch.testing.assert_close(out[i, :n], expect[i], atol=ATOL, rtol=ATOL)
    for layer in range(TINY.num_hidden_layers):
        torch.testing.assert_close(batched.k[layer][:-1], solo.k[layer][:-1], atol=ATOL, rtol=ATOL)


def test_rotate_keys_moves_positions(models: tuple) -> None:
    ours, _ = models
    keys = torch.randn(2, 5, TINY.head_dim)
    cos, sin = ours.rope(torch.full((1, 5), 30), torch.float32)
    rotated = keys * cos[0, 0] + torch.cat((-keys[..., 16:], keys[..., :16]), -1) * sin[0, 0]
    cos2, sin2 = ours.rope(torch.full((1, 5), 18), torch.float32)
    expect = keys * cos2[0, 0] + torch.cat((-keys[..., 16:], keys[..., :16]), -1) * sin2[0, 0]
    torch.testing.assert_close(ours.rotate_keys(rotated, 12), expect, atol=ATOL, rtol=ATOL)


def test_dense_layout_equals_gathered_slots(models: tuple) -> None:
    """Row i = slot i with no gather; an idle row writes only the reserved last position."""
    ours, _ = models
    gen = torch.Generator().manual_seed(4)
    kv = SlotKVCache.allocate(TINY, slots=3, max_len=16, dtype=torch.float32)
    for slot, n in ((0, 4), (2, 9)):
        _feed(ours, kv, slot, torch.randn(n, TINY.hidden_size, generator=gen), 0)
    idle_before = kv.k[0][1].clone()
    gathered = SlotKVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v])
    x = torch.randn(3, 1, TINY.hidden_size, generator=gen)
    with torch.no_grad():
        dense = ours(x, torch.tensor([[4], [kv.reserved_pos], [9]]), None, kv, kv_limit=12)
        want = ours(x[[0, 2]], torch.tensor([[4], [9]]), torch.tensor([0, 2]), gathered)
    torch.testing.assert_close(dense[[0, 2]], want, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(kv.k[1][:-1, :, :-1], gathered.k[1][:-1, :, :-1], atol=ATOL, rtol=ATOL)
    assert torch.equal(kv.k[0][1, :, :-1], idle_before[:, :-1])


def _clone(model: Qwen3LLM) -> Qwen3LLM:
    twin = Qwen3LLM(model.cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize(("fold_gqa", "decode_attention"), [(True, "matmul"), (True, "sdpa"), (False, "sdpa")])
def test_fused_projections_keep_keys_and_outputs(models: tuple, fold_gqa: bool, decode_attention: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """fuse_projections(): same state_dict keys and values, same outputs as transformers (every attention
    variant; the segments include single-token decode steps); a later load_state_dict (also after a dtype
    move) reaches the fused matmuls."""
    ours, ref = models
    monkeypatch.setattr(Qwen3LLM, "fold_gqa", fold_gqa)
    monkeypatch.setattr(Qwen3LLM, "decode_attention", decode_attention)
    fused = _clone(ours).fuse_projections()
    assert fused.fused and set(fused.state_dict()) == set(ours.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value)
    emb = torch.randn(23, TINY.hidden_size, generator=torch.Generator().manual_seed(5))
    hidden_ref, _ = _reference(ref, emb)
    for segments in ([23], [11, 1, 1, 2, 8]):
        kv = SlotKVCache.allocate(TINY, slots=2, max_len=32, dtype=torch.float32)
        outs, start = [], 0
        for n in segments:
            outs.append(_feed(fused, kv, 1, emb[start:start + n], start))
            start += n
        torch.testing.assert_close(torch.cat(outs), hidden_ref, atol=ATOL, rtol=ATOL)
    moved = fused.to(torch.float64)
    moved.load_state_dict({k: v.mul(0.5) for k, v in ours.state_dict().items()})
    attn = moved.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == torch.float64
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    torch.testing.assert_close(attn.qkv_weight[:attn.q_proj.weight.shape[0]],
                               ours.model.layers[0].self_attn.q_proj.weight.double() * 0.5)
    gate_up = moved.model.layers[1].mlp.gate_up_weight
    torch.testing.assert_close(gate_up[TINY.intermediate_size:], ours.model.layers[1].mlp.up_proj.weight.double() * 0.5)


def test_fused_lm_head_pads_an_unaligned_vocab_and_keeps_its_logits() -> None:
    """fuse_projections() pads the lm_head's rows to a multiple of LM_HEAD_ALIGN (a vocab like MiniCPM-o's 151,748
    ran a slower GEMM): the logits keep the vocab's width and values, the state_dict its keys and shapes, and the
    weight stays a view of the padded buffer after a dtype move, so a later load_state_dict reaches the logits."""
    from engine.model.llm import LM_HEAD_ALIGN

    cfg = dataclasses.replace(TINY, vocab_size=300)  # not a multiple of 64
    model = Qwen3LLM(cfg).eval()
    hidden = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model.logits(hidden)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        fused = model.fuse_projections()
        got = fused.logits(hidden)
    assert fused.lm_head_padded.shape == (320, cfg.hidden_size) and 320 % LM_HEAD_ALIGN == 0
    assert got.shape == (3, 300)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert {k: tuple(v.shape) for k, v in fused.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}
    moved = fused.to(torch.float64)
    moved.load_state_dict({k: v.double() * 0.5 for k, v in state.items()})
    assert moved.lm_head.weight.untyped_storage().data_ptr() == moved.lm_head_padded.untyped_storage().data_ptr()
    assert torch.equal(moved.lm_head_padded[300:], torch.zeros(20, cfg.hidden_size, dtype=torch.float64))
    with torch.no_grad():
        torch.testing.assert_close(moved.logits(hidden.double()),
                                   hidden.double() @ state["lm_head.weight"].double().mul(0.5).T, atol=1e-9, rtol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_decode_attention_variants_agree(models: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the GPU (§9.6 tolerance 2e-2 on logits): matmul decode attention = SDPA kernels."""
    ours, _ = models
    model = _clone(ours).cuda().to(torch.bfloat16).fuse_projections()
    emb = torch.randn(30, TINY.hidden_size, generator=torch.Generator().manual_seed(6)).cuda().bfloat16()
    logits = []
    for attention in ("matmul", "sdpa"):
        monkeypatch.setattr(Qwen3LLM, "decode_attention", attention)
        kv = SlotKVCache.allocate(TINY, slots=2, max_len=32, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            model(emb[None, :29], torch.arange(29, device="cuda")[None], torch.tensor([1], device="cuda"), kv)
            h = model(emb[None, 29:], torch.tensor([[29]], device="cuda"), torch.tensor([1], device="cuda"), kv)
        logits.append(model.logits(h).float())
    torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=2e-2)
