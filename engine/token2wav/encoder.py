"""`UpsampleConformerEncoderV2`, streaming path only (model.md §1.6, §6.5 step 1).

Parameter names match `flow.pt` under `encoder.`. Caches are plain tensors passed in and returned
(never module state), so every session owns its own:
  cnn cache  [B, D, 6]          2 frames of the pre-lookahead conv2 input + 4 of the upsample conv
  att cache  [Lt + Lm, B, H, T, 2·dk]   token-rate layers store their history tiled twice along T
                                        (reference packing), so all layers share T = mel frames.
Every conformer block runs through `UpsampleConformerEncoder.block_fn` (eager, or one torch.compile'd block
for all ten: `CausalMaskedDiffWithXvec.compile_blocks`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import LayerFn, run_layer
from engine.token2wav.config import FlowConfig


def rel_pos_table(max_len: int, dim: int) -> torch.Tensor:
    """ESPnet relative table [2·max_len − 1, dim]: positions max_len−1 … 0 … −(max_len−1)."""
    position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    pos = torch.zeros(max_len, dim)
    neg = torch.zeros(max_len, dim)
    pos[:, 0::2] = torch.sin(position * div_term)
    pos[:, 1::2] = torch.cos(position * div_term)
    neg[:, 0::2] = torch.sin(-1 * position * div_term)
    neg[:, 1::2] = torch.cos(-1 * position * div_term)
    return torch.cat([torch.flip(pos, [0]), neg[1:]], dim=0)


class LinearInput(nn.Module):
    """Linear → LayerNorm → ×√D (`LinearNoSubsampling` + the positional-encoding scale)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim, eps=eps))
        self.xscale = math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class PreLookaheadLayer(nn.Module):
    def __init__(self, dim: int, lookahead: int, kernel2: int, slope: float) -> None:
        super().__init__()
        self.lookahead, self.slope = lookahead, slope
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=kernel2)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, m, D] (already padded by `lookahead` zeros on the last chunk); cache [B, D, k2−1]
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)), self.slope)        # [B, D, m − 3]
        new_cache = h[..., -cache.shape[2]:]
        h = self.conv2(torch.cat([cache, h], dim=2)).transpose(1, 2)        # [B, m − 3, D]
        return h + x[:, : -self.lookahead], new_cache


class RelSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        # [B, H, t1, 2S − 1] → [B, H, t1, S]: entry (i, j) reads distance (S − t1 + i) − j.
        b, h, t1, n = x.shape
        padded = torch.cat([x.new_zeros(b, h, t1, 1), x], dim=-1).view(b, h, n + 1, t1)
        return padded[:, :, 1:].view_as(x)[:, :, :, : n // 2 + 1]

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, cache: torch.Tensor | None,
                key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """key_mask [B, S] (True = attend) hides the padding of a ragged batch (ragged.py)."""
        b, t1, _ = x.shape
        q = self.linear_q(x).view(b, t1, self.h, self.d_k)                  # [B, t1, H, dk]
        k = self.linear_k(x).view(b, t1, self.h, self.d_k).transpose(1, 2)  # [B, H, t1, dk]
        v = self.linear_v(x).view(b, t1, self.h, self.d_k).transpose(1, 2)
        if cache is not None and cache.shape[2] > 0:
            k_cache, v_cache = cache.split(self.d_k, dim=-1)
            k = torch.cat([k_cache, k], dim=2)                              # old first
            v = torch.cat([v_cache, v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)                                # [B, H, S, 2dk]
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)  # [1, H, 2S−1, dk]
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        ac = torch.matmul(q_u, k.transpose(-2, -1))                          # [B, H, t1, S]
        bd = torch.matmul(q_v, p.transpose(-2, -1))                          # [B, H, t1, 2S−1]
        if ac.shape != bd.shape:
            bd = self.rel_shift(bd)
        scores = (ac + bd) / math.sqrt(self.d_k)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t1, self.h * self.d_k)
        return self.linear_out(out), new_cache


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    """x + MHA(LN(x)), then x + FFN(LN(x)); no conv module, no macaron (§1.6)."""

    def __init__(self, dim: int, heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = RelSelfAttention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.norm_ff = nn.LayerNorm(dim, eps=eps)
        self.norm_mha = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, cache: torch.Tensor | None,
                key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        att, new_cache = self.self_attn(self.norm_mha(x), pos_emb, cache, key_mask)
        x = x + att
        return x + self.feed_forward(self.norm_ff(x)), new_cache


class Upsample1D(nn.Module):
    """Nearest ×stride repeat, then a causal Conv1d (k = 2·stride + 1) with 2·stride frames of history."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, stride * 2 + 1)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, D, t]; cache [B, D, 2·stride]
        up = torch.cat([cache, x.repeat_interleave(self.stride, dim=2)], dim=2)
        return self.conv(up), up[..., -self.stride * 2:]


def run_conformer_block(block: ConformerBlock, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """block(*args): the conformer's unit of regional compilation, its own code object (see `run_dit_block`)."""
    return block(*args)


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        d = cfg.enc_dim
        self.cfg = cfg
        self.embed = LinearInput(d, cfg.enc_ln_eps)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len, cfg.pre_lookahead_conv2_kernel,
                                                     cfg.leaky_slope)
        block = lambda: ConformerBlock(d, cfg.enc_heads, cfg.enc_linear_units, cfg.block_ln_eps)  # noqa: E731
        self.encoders = nn.ModuleList([block() for _ in range(cfg.enc_blocks)])
        self.up_layer = Upsample1D(d, cfg.up_stride)
        self.up_embed = LinearInput(d, cfg.enc_ln_eps)
        self.up_encoders = nn.ModuleList([block() for _ in range(cfg.enc_up_blocks)])
        self.after_norm = nn.LayerNorm(d, eps=cfg.enc_ln_eps)
        self.register_buffer("pe", rel_pos_table(cfg.rel_pos_max_len, d), persistent=False)
        self.block_fn: LayerFn = run_layer

    def _pos(self, size: int) -> torch.Tensor:
        # [2·size − 1, D] centred on distance 0 (EspnetRelPositionalEncoding.position_encoding)
        mid = self.pe.shape[0] // 2
        return self.pe[mid - size + 1: mid + size].to(self.after_norm.weight.dtype)

    def forward_chunk(self, xs: torch.Tensor, last: bool, cnn_cache: torch.Tensor | None,
                      att_cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xs [B, m, D] token embeddings → (h [B, F, D], cnn cache [B, D, 6], att cache [L, B, H, T', 2dk])."""
        cfg, b = self.cfg, xs.shape[0]
        n_tok = len(self.encoders)
        k2 = cfg.pre_lookahead_conv2_kernel - 1
        if cnn_cache is None:
            cnn_cache = xs.new_zeros(b, cfg.enc_dim, cfg.enc_cnn_cache_len)
        half = att_cache.shape[3] // 2 if att_cache is not None else 0
        xs = self.embed(xs)
        if last:
            xs = F.pad(xs, (0, 0, 0, cfg.pre_lookahead_len))
        xs, new_cnn1 = self.pre_lookahead_layer(xs, cnn_cache[:, :, :k2])
        pos = self._pos(half + xs.shape[1])
        new_att1 = []
        for i, layer in enumerate(self.encoders):
            cache = att_cache[i, :, :, :half] if att_cache is not None else None
            xs, c = self.block_fn(layer, xs, pos, cache)
            new_att1.append(c)
        xs, new_cnn2 = self.up_layer(xs.transpose(1, 2), cnn_cache[:, :, k2:])
        xs = self.up_embed(xs.transpose(1, 2))
        pos = self._pos(half * cfg.up_stride + xs.shape[1])
        new_att2 = []
        for i, layer in enumerate(self.up_encoders):
            cache = att_cache[n_tok + i] if att_cache is not None else None
            xs, c = self.block_fn(layer, xs, pos, cache)
            new_att2.append(c)
        xs = self.after_norm(xs)
        tok = torch.stack(new_att1, dim=0)
        new_att = torch.cat([tok.repeat(1, 1, 1, cfg.up_stride, 1), torch.stack(new_att2, dim=0)], dim=0)
        return xs, torch.cat([new_cnn1, new_cnn2], dim=2), new_att
