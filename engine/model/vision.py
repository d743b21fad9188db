"""SigLIP vision tower (navit position bucketing) and the perceiver resampler (model.md §1.4, §8.3).

Keys equal the checkpoint's `vpm.*` / `resampler.*` keys without the prefix. Only `cfg.layers_used`
encoder layers exist (the dropped last layer is never built). Duplex sends one slice per frame, so
the tower takes one image (or a batch of same-size images) without a patch padding mask.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig

RESAMPLER_HEAD_DIM = 128  # resampler heads = embed_dim / 128 (model.md C2)
RESAMPLER_LN_EPS = 1e-6
RESAMPLER_MAX_GRID = (70, 70)  # initial sin-cos grid; grows on demand like the reference
SINCOS_BASE = 10_000.0
PIXEL_MEAN = PIXEL_STD = 0.5  # preprocessor_config.json (SigLIP)
PIXEL_MAX = 255.0
NAVIT_EPS = 1e-6  # the reference's `arange(0, 1 - 1e-6, 1 / n)`


def navit_position_ids(nb_h: int, nb_w: int, per_side: int) -> torch.Tensor:
    """Bucket a (nb_h x nb_w) patch grid fractionally into the per_side² table -> [nb_h * nb_w].

    Same float32 arithmetic as `modeling_navit_siglip`: ties (e.g. 16/32 vs 35/70) must land identically.
    """
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    step_h = (1 / torch.tensor(nb_h, dtype=torch.int32)).item()  # float32 step, as from int tgt_sizes
    step_w = (1 / torch.tensor(nb_w, dtype=torch.int32)).item()
    bucket_h = torch.bucketize(torch.arange(0, 1 - NAVIT_EPS, step_h), boundaries, right=True)
    bucket_w = torch.bucketize(torch.arange(0, 1 - NAVIT_EPS, step_w), boundaries, right=True)
    return (bucket_h[:, None] * per_side + bucket_w).flatten()


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.per_side = cfg.image_size // cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] (H, W multiples of the patch) -> [B, (H/p)(W/p), hidden], row-major patches."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # [B, hidden, H/p, W/p]
        nb_h, nb_w = x.shape[2], x.shape[3]
        pos = navit_position_ids(nb_h, nb_w, self.per_side).to(x.device)  # [P]
        return x.flatten(2).transpose(1, 2) + self.position_embedding(pos)


class SiglipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, d // cfg.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # gelu_pytorch_tanh


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.layers_used))


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported")
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised pixels [B, 3, H, W] -> post-LN patch states [B, P, hidden]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def sincos_2d(embed_dim: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """[grid_h, grid_w, embed_dim] float32, bit-compatible with the reference numpy recipe.

    The first half encodes the column (w) index, the second half the row: the reference meshgrid
    puts w first and calls that half "emb_h".
    """
    grid = np.stack(np.meshgrid(np.arange(grid_w, dtype=np.float32), np.arange(grid_h, dtype=np.float32)))
    half = embed_dim // 2
    omega = np.arange(half // 2, dtype=np.float32)
    omega /= half / 2.0
    omega = 1.0 / SINCOS_BASE ** omega  # [half / 2]

    def one_d(pos: np.ndarray) -> np.ndarray:
        out = np.einsum("hw,d->hwd", pos, omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=-1)

    return torch.from_numpy(np.concatenate([one_d(grid[0]), one_d(grid[1])], axis=-1)).float()


class ResamplerAttention(nn.Module):
    """nn.MultiheadAttention's parameter layout (`in_proj_*`, `out_proj`), computed with SDPA."""

    def __init__(self, embed_dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, embed_dim // heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3)

        def split(t: torch.Tensor) -> torch.Tensor:
            b, s, _ = t.shape
            return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]

        out = F.scaled_dot_product_attention(split(F.linear(q, wq, bq)), split(F.linear(k, wk, bk)),
                                             split(F.linear(v, wv, bv)))  # [B, H, Q, D]
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class Resampler(nn.Module):
    """64 learnable queries cross-attend to the patch states (+ 2-D sin-cos on keys) -> [B, Q, embed]."""

    def __init__(self, cfg: VisionConfig, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Parameter(torch.zeros(cfg.query_num, embed_dim))
        self.kv_proj: nn.Module = (nn.Linear(cfg.hidden_size, embed_dim, bias=False)
                                   if cfg.hidden_size != embed_dim else nn.Identity())
        self.attn = ResamplerAttention(embed_dim, max(1, embed_dim // RESAMPLER_HEAD_DIM))
        self.ln_q = nn.LayerNorm(embed_dim, eps=RESAMPLER_LN_EPS)
        self.ln_kv = nn.LayerNorm(embed_dim, eps=RESAMPLER_LN_EPS)
        self.ln_post = nn.LayerNorm(embed_dim, eps=RESAMPLER_LN_EPS)
        self.proj = nn.Parameter(embed_dim ** -0.5 * torch.randn(embed_dim, embed_dim))
        self.register_buffer("pos_embed", sincos_2d(embed_dim, *RESAMPLER_MAX_GRID), persistent=False)

    def _pos(self, nb_h: int, nb_w: int, device: torch.device) -> torch.Tensor:
        grid_h, grid_w = self.pos_embed.shape[:2]
        if nb_h > grid_h or nb_w > grid_w:  # grow on demand, as the reference does
            self.pos_embed = sincos_2d(self.embed_dim, max(nb_h, grid_h), max(nb_w, grid_w)).to(device)
        return self.pos_embed[:nb_h, :nb_w].reshape(nb_h * nb_w, -1)  # [P, embed]

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch states [B, P, kv_dim] of a (nb_h, nb_w) grid -> [B, query_num, embed_dim]."""
        kv = self.ln_kv(self.kv_proj(x))  # [B, P, embed]
        # the table is built on the host (numpy); a model built under `torch.device(...)` keeps it there
        pos = self._pos(*grid, x.device).to(x.device, kv.dtype)
        q = self.ln_q(self.query).expand(x.shape[0], -1, -1)  # [B, Q, embed]
        out = self.attn(q, kv + pos, kv)
        return self.ln_post(out) @ self.proj


@torch.inference_mode()
def encode_frame(tower: SiglipVisionTower, resampler: Resampler, image: torch.Tensor) -> torch.Tensor:
    """One RGB frame uint8 [H, W, 3] (sides multiples of the patch, e.g. 448²) -> [query_num, embed].

    The caller resizes to the slice size (MiniCPM's `find_best_resize`); here only SigLIP scaling
    ((x/255 - 0.5) / 0.5) and one navit slice.
    """
    p = tower.cfg.patch_size
    h, w, c = image.shape
    if h % p or w % p or c != tower.cfg.num_channels:
        raise ValueError(f"frame {tuple(image.shape)}: sides must be multiples of {p} with {c} channels")
    dev = tower.post_layernorm.weight.device
    pixels = (image.to(dev, torch.float32) / PIXEL_MAX - PIXEL_MEAN) / PIXEL_STD  # [H, W, 3]
    states = tower(pixels.permute(2, 0, 1)[None])  # [1, P, hidden]
    return resampler(states, (h // p, w // p))[0]


@torch.inference_mode()
def encode_frames(tower: SiglipVisionTower, resampler: Resampler, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """Many RGB frames uint8 [H_i, W_i, 3] -> [query_num, embed] each, in order.

    Frames of one size run as one batch through the tower and the resampler (one slice each, no padding
    mask needed); a batch per distinct size.
    """
    p = tower.cfg.patch_size
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        h, w, c = image.shape
        if h % p or w % p or c != tower.cfg.num_channels:
            raise ValueError(f"frame {tuple(image.shape)}: sides must be multiples of {p} with {c} channels")
        by_size.setdefault((h, w), []).append(i)
    dev = tower.post_layernorm.weight.device
    out: list[torch.Tensor | None] = [None] * len(images)
    for (h, w), idx in by_size.items():
        batch = torch.stack([images[i] for i in idx]).to(dev, torch.float32)  # [B, H, W, 3]
        pixels = (batch / PIXEL_MAX - PIXEL_MEAN) / PIXEL_STD
        states = tower(pixels.permute(0, 3, 1, 2))  # [B, P, hidden]
        for i, emb in zip(idx, resampler(states, (h // p, w // p)), strict=True):
            out[i] = emb
    return out  # type: ignore[return-value] - every index is filled above
