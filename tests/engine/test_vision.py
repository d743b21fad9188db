"""SigLIP tower + resampler: parity with transformers and with the reference recipes (model.md §1.4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import SiglipVisionConfig
from transformers.models.siglip.modeling_siglip import SiglipVisionModel

from engine.config import VisionConfig
from engine.model.vision import Resampler, SiglipVisionTower, encode_frame, navit_position_ids

EMBED = 128


def tiny_vision(image_size: int = 28) -> VisionConfig:
    return VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        patch_size=14, image_size=image_size, query_num=64)


def randomize_(module: nn.Module, seed: int, std: float = 0.1) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            base = 1.0 if ("norm" in name or name.split(".")[0].startswith("ln_")) and name.endswith("weight") else 0.0
            p.copy_(base + std * torch.randn(p.shape, generator=g))
    return module.eval()


def ref_navit_position_ids(tgt_h: int, tgt_w: int, per_side: int) -> torch.Tensor:
    """Transcription of SiglipVisionEmbeddings.forward in modeling_navit_siglip (one image)."""
    tgt_sizes = torch.tensor([[tgt_h, tgt_w]], dtype=torch.int32)
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    nb_patches_h, nb_patches_w = tgt_sizes[0][0], tgt_sizes[0][1]
    fractional_coords_h = torch.arange(0, 1 - 1e-6, 1 / nb_patches_h)
    fractional_coords_w = torch.arange(0, 1 - 1e-6, 1 / nb_patches_w)
    bucket_coords_h = torch.bucketize(fractional_coords_h, boundaries, right=True)
    bucket_coords_w = torch.bucketize(fractional_coords_w, boundaries, right=True)
    return (bucket_coords_h[:, None] * per_side + bucket_coords_w).flatten()


def ref_sincos(embed_dim: int, grid_h: int, grid_w: int) -> np.ndarray:
    """Transcription of get_2d_sincos_pos_embed (resampler)."""
    def one_d(dim: int, pos: np.ndarray) -> np.ndarray:
        omega = np.arange(dim // 2, dtype=np.float32)
        omega /= dim / 2.0
        omega = 1.0 / 10000 ** omega
        out = np.einsum("hw,d->hwd", pos, omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=-1)

    grid = np.stack(np.meshgrid(np.arange(grid_w, dtype=np.float32), np.arange(grid_h, dtype=np.float32)), axis=0)
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=-1)


def ref_resampler(r: Resampler, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Transcription of the reference Resampler.forward using torch's nn.MultiheadAttention (L, B, D)."""
    heads = r.attn.heads
    mha = nn.MultiheadAttention(EMBED, heads).eval()
    mha.load_state_dict(r.attn.state_dict())
    tgt_h, tgt_w = grid
    pos = torch.from_numpy(ref_sincos(EMBED, 70, 70)).float()[:tgt_h, :tgt_w].reshape(tgt_h * tgt_w, -1)
    bs = x.shape[0]
    kv = r.ln_kv(r.kv_proj(x)).permute(1, 0, 2)  # L * B * D
    q = r.ln_q(r.query).unsqueeze(1).repeat(1, bs, 1)  # Q * B * D
    out = mha(q, kv + pos[:, None], kv, key_padding_mask=torch.zeros(bs, tgt_h * tgt_w, dtype=torch.bool))[0]
    return r.ln_post(out.permute(1, 0, 2)) @ r.proj


def test_keys_hold_only_used_layers() -> None:
    tower, res = SiglipVisionTower(tiny_vision()), Resampler(tiny_vision(), EMBED)
    keys = set(tower.state_dict())
    assert "encoder.layers.0.self_attn.q_proj.weight" in keys and not any(".layers.1." in k for k in keys)
    assert tower.state_dict()["embeddings.position_embedding.weight"].shape == (4, 32)
    assert set(res.state_dict()) == {"query", "proj", "kv_proj.weight", "attn.in_proj_weight", "attn.in_proj_bias",
                                     "attn.out_proj.weight", "attn.out_proj.bias", "ln_q.weight", "ln_q.bias",
                                     "ln_kv.weight", "ln_kv.bias", "ln_post.weight", "ln_post.bias"}
    assert res.state_dict()["query"].shape == (64, EMBED) and res.attn.heads == 1


def test_tower_matches_transformers_siglip() -> None:
    tower = randomize_(SiglipVisionTower(tiny_vision()), seed=0)
    hf_cfg = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                patch_size=14, image_size=28, layer_norm_eps=1e-6, vision_use_head=False,
                                hidden_act="gelu_pytorch_tanh", attention_dropout=0.0)
    hf = SiglipVisionModel(hf_cfg).eval()
    hf.load_state_dict(tower.state_dict(), strict=True)
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels), hf(pixels).last_hidden_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,w,side", [(2, 2, 2), (3, 2, 2), (1, 4, 2), (32, 32, 70), (24, 42, 70), (70, 70, 70),
                                      (17, 29, 32)])
def test_navit_bucketing_matches_reference(h: int, w: int, side: int) -> None:
    assert torch.equal(navit_position_ids(h, w, side), ref_navit_position_ids(h, w, side))


def test_non_square_frame_uses_bucketed_positions() -> None:
    """A 42x28 frame (3x2 patches) on the 2x2 table: embeddings use the bucketed rows."""
    tower = randomize_(SiglipVisionTower(tiny_vision()), seed=2)
    pixels = torch.randn(1, 3, 42, 28, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        emb = tower.embeddings(pixels)
        patches = tower.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        pos = tower.embeddings.position_embedding.weight[ref_navit_position_ids(3, 2, 2)]
    torch.testing.assert_close(emb, patches + pos, atol=0, rtol=0)


@pytest.mark.parametrize("grid", [(2, 2), (2, 3)])
def test_resampler_matches_reference(grid: tuple[int, int]) -> None:
    res = randomize_(Resampler(tiny_vision(), EMBED), seed=3)
    x = torch.randn(2, grid[0] * grid[1], 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(res(x, grid), ref_resampler(res, x, grid), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(res.pos_embed.numpy(), ref_sincos(EMBED, 70, 70), atol=0, rtol=0)


def test_resampler_pos_grid_grows_on_demand() -> None:
    res = randomize_(Resampler(tiny_vision(), EMBED), seed=5)
    x = torch.randn(1, 72, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = res(x, (1, 72))
    assert out.shape == (1, 64, EMBED) and res.pos_embed.shape[:2] == (70, 72)
    np.testing.assert_allclose(res.pos_embed.numpy(), ref_sincos(EMBED, 70, 72), atol=0, rtol=0)


def test_encode_frame_preprocessing_and_determinism() -> None:
    cfg = tiny_vision()
    tower, res = randomize_(SiglipVisionTower(cfg), seed=6), randomize_(Resampler(cfg, EMBED), seed=7)
    image = torch.randint(0, 256, (28, 28, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    out = encode_frame(tower, res, image)
    assert out.shape == (64, EMBED)
    pixels = (image.permute(2, 0, 1).float()[None] / 255.0 - 0.5) / 0.5  # SigLIP mean = std = 0.5
    with torch.no_grad():
        torch.testing.assert_close(out, res(tower(pixels), (2, 2))[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(out, encode_frame(tower, res, image.clone()))
    with pytest.raises(ValueError):
        encode_frame(tower, res, torch.zeros(30, 28, 3, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encode_frame_on_cuda_bf16() -> None:
    cfg = tiny_vision()
    tower, res = randomize_(SiglipVisionTower(cfg), seed=8), randomize_(Resampler(cfg, EMBED), seed=9)
    image = torch.randint(0, 256, (28, 42, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    ref = encode_frame(tower, res, image)
    out = encode_frame(tower.cuda().bfloat16(), res.cuda().bfloat16(), image.cuda())
    assert out.dtype == torch.bfloat16 and out.shape == (64, EMBED)
    torch.testing.assert_close(out.float().cpu(), ref, atol=5e-2, rtol=5e-2)
