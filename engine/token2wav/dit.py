"""DiT estimator of the CFM (model.md §1.6), streaming path.

Parameter names match `flow.pt` under `decoder.estimator.`. Caches are arguments and results, never
module state (the reference writes them into module scratch buffers, §6.8):
  cnn cache [depth, B, 2·C, k − 1]   conv1 input history ‖ conv2 input history
  att cache [depth, B, H, T, 2·hd]   k ‖ v, stored newest-first ([new, older …]) like the reference
`key_mask` (optional, True = attend): [B, F + T] per key, or [B, F, F + T] per query (the offline
block-causal check of streaming == offline uses the latter).
Every block runs through `DiT.block_fn`: eager by default, or one torch.compile'd block for all blocks
(`compile_blocks`, regional compilation as in the LLM and TTS).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import LayerFn, allow_recompiles, compile_symbolic, run_layer
from engine.token2wav.config import FlowConfig


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int, scale: float, max_period: float) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.scale = scale
        half = freq_dim // 2
        # computed on CPU in fp32 like the reference; a buffer so graph capture needs no host copy
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half) / half)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # t [B] in [0, 1] → [B, hidden]; sinusoid [cos half, sin half] of t·1000
        args = (t * self.scale)[:, None] * self.freqs.to(t)[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim, eps=eps)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps)
        self.proj = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None, key_mask: torch.Tensor | None,
                out: torch.Tensor, wpos: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the new cache [B, H, t + T, 2hd] (k ‖ v, newest first) straight into `out`.

        Ragged mode (`wpos` [B, t] given): `out` [B, H, Tg, 2hd] already holds the old K/V at
        physical positions; the new K/V go to `wpos` and attention covers `key_mask` (order-free:
        the DiT has no positions, so the physical order of the frames does not matter).
        """
        b, t, _ = x.shape
        hd = self.head_dim
        heads = lambda y: y.reshape(b, t, self.heads, hd).transpose(1, 2)  # noqa: E731
        q = self.q_norm(heads(self.to_q(x)))                                  # [B, H, t, hd]
        if wpos is not None:
            idx = wpos[:, None, :, None].expand(-1, self.heads, -1, hd)       # [B, H, t, hd]
            out[..., :hd].scatter_(2, idx, self.k_norm(heads(self.to_k(x))))
            out[..., hd:].scatter_(2, idx, heads(self.to_v(x)))
        else:
            out[:, :, :t, :hd] = self.k_norm(heads(self.to_k(x)))
            out[:, :, :t, hd:] = heads(self.to_v(x))
            if cache is not None:
                out[:, :, t:] = cache                                         # older frames after the new
        mask = None if key_mask is None else key_mask[:, None] if key_mask.dim() == 3 else key_mask[:, None, None, :]
        o = F.scaled_dot_product_attention(q, out[..., :hd], out[..., hd:], attn_mask=mask)  # no positions
        return self.proj(o.transpose(1, 2).reshape(b, t, -1))


class CausalConv(nn.Conv1d):
    def forward_cached(self, x: torch.Tensor, cache: torch.Tensor, end: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, C, t]; cache [B, C, k − 1]; end [B, k − 1]: per-row new-cache positions of a ragged batch
        x = torch.cat([cache, x], dim=2)
        if end is None:
            return self.forward(x), x[..., -cache.shape[2]:]
        return self.forward(x), x.gather(2, end[:, None, :].expand(-1, x.shape[1], -1))


class Mish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mish(x)


class CausalConvBlock(nn.Module):
    """conv → LayerNorm → Mish → conv, both convs causal. Indices 1/3/6 match `conv.block.{1,3,6}`."""

    def __init__(self, dim: int, kernel: int) -> None:
        super().__init__()
        self.dim = dim
        self.block = nn.ModuleList([nn.Identity(), CausalConv(dim, dim, kernel), nn.Identity(),
                                    nn.LayerNorm(dim), Mish(), nn.Identity(), CausalConv(dim, dim, kernel)])

    def forward(self, x: torch.Tensor, cache: torch.Tensor, end: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, t, C]; cache [B, 2C, k − 1]
        c1, c2 = cache.split((self.dim, self.dim), dim=1)
        h, n1 = self.block[1].forward_cached(x.transpose(1, 2), c1, end)
        h = self.block[4](self.block[3](h.transpose(1, 2)))
        h, n2 = self.block[6].forward_cached(h.transpose(1, 2), c2, end)
        return h.transpose(1, 2), torch.cat([n1, n2], dim=1)


class DiTBlock(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        d = cfg.dit_hidden
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.dit_ln_eps)
        self.attn = Attention(d, cfg.dit_heads, cfg.dit_head_dim, cfg.qk_ln_eps)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.dit_ln_eps)
        hidden = int(d * cfg.dit_mlp_ratio)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(d, hidden), "fc2": nn.Linear(hidden, d)})
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.dit_ln_eps)
        self.conv = CausalConvBlock(d, cfg.dit_conv_kernel)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 9 * d))

    def forward(self, x: torch.Tensor, c: torch.Tensor, cnn_cache: torch.Tensor, att_cache: torch.Tensor | None,
                key_mask: torch.Tensor | None, att_out: torch.Tensor, wpos: torch.Tensor | None = None,
                cnn_end: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # order of the 9 chunks: attention, MLP, conv (shift, scale, gate each); execution: attn, conv, MLP
        sa, ca, ga, sm, cm, gm, sc, cc, gc = self.adaLN_modulation(c).chunk(9, dim=-1)
        h = self.attn(modulate(self.norm1(x), sa, ca), att_cache, key_mask, att_out, wpos)
        x = x + ga * h
        h, new_cnn = self.conv(modulate(self.norm3(x), sc, cc), cnn_cache, cnn_end)
        x = x + gc * h
        h = modulate(self.norm2(x), sm, cm)
        x = x + gm * self.mlp["fc2"](F.gelu(self.mlp["fc1"](h), approximate="tanh"))
        return x, new_cnn


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out: int, eps: float) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=eps)
        self.linear = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def run_dit_block(block: DiTBlock, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """block(*args): the DiT's unit of regional compilation. Its own code object (not `run_layer`): dynamo
    caps the compiled variants per code object, and the conformer's and HiFT's blocks have theirs."""
    return block(*args)


class DiT(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.dit_hidden, cfg.t_freq_dim, cfg.t_scale, cfg.t_max_period)
        self.in_proj = nn.Linear(cfg.dit_in_channels, cfg.dit_hidden)
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.dit_depth)])
        self.final_layer = FinalLayer(cfg.dit_hidden, cfg.dit_out_channels, cfg.dit_ln_eps)
        self.block_fn: LayerFn = run_layer

    def compile_blocks(self) -> None:
        """Run every block through one torch.compile'd block (dynamic sizes): its ~40 small kernels fuse
        into fewer, and a CUDA graph captured after that replays the fused ones. Fused kernels round
        differently from eager, so the mel is close to, not bit-equal with, the eager blocks'."""
        allow_recompiles(8)  # a few shapes: one row and more, the chunk and ragged calls
        self.block_fn = compile_symbolic(run_dit_block)

    def cnn_cache_shape(self, batch: int) -> tuple[int, ...]:
        return (self.cfg.dit_depth, batch, 2 * self.cfg.dit_hidden, self.cfg.dit_conv_kernel - 1)

    def _embed(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.t_embedder(t).unsqueeze(1)                                    # [B, 1, hidden]
        spk = spks[:, :, None].expand(-1, -1, x.shape[2])
        return self.in_proj(torch.cat([x, mu, spk, cond], dim=1).transpose(1, 2)), c   # [B, F, hidden]

    def forward_chunk(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                      cond: torch.Tensor, cnn_cache: torch.Tensor | None, att_cache: torch.Tensor | None,
                      key_mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, mu, cond [B, 80, F]; t [B]; spks [B, 80] → (v [B, 80, F], cnn cache, att cache)."""
        h, c = self._embed(x, mu, t, spks, cond)
        if cnn_cache is None:
            cnn_cache = x.new_zeros(self.cnn_cache_shape(x.shape[0]))
        cfg, (b, t) = self.cfg, (x.shape[0], x.shape[2])
        past = att_cache.shape[3] if att_cache is not None else 0
        # every block writes its new cache in place: no per-block cat + final stack copies
        new_att = x.new_empty(cfg.dit_depth, b, cfg.dit_heads, t + past, 2 * cfg.dit_head_dim)
        new_cnn = []
        for i, block in enumerate(self.blocks):
            h, nc = self.block_fn(block, h, c, cnn_cache[i], att_cache[i] if att_cache is not None else None,
                                  key_mask, new_att[i])
            new_cnn.append(nc)
        out = self.final_layer(h, c).transpose(1, 2)                           # [B, 80, F]
        return out, torch.stack(new_cnn), new_att

    def forward_ragged(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                       cond: torch.Tensor, cnn_cache: torch.Tensor, kv: torch.Tensor, key_mask: torch.Tensor,
                       wpos: torch.Tensor, cnn_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged rows (right-padded frames). kv [depth, B, H, Tg, 2hd] holds the old K/V at physical
        positions and receives the new K/V at `wpos` [B, F] in place; key_mask [B, Tg]; cnn_end [B, k − 1]
        picks each row's new conv history → (v [B, 80, F], cnn cache [depth, B, 2C, k − 1])."""
        h, c = self._embed(x, mu, t, spks, cond)
        new_cnn = []
        for i, block in enumerate(self.blocks):
            h, nc = self.block_fn(block, h, c, cnn_cache[i], None, key_mask, kv[i], wpos, cnn_end)
            new_cnn.append(nc)
        return self.final_layer(h, c).transpose(1, 2), torch.stack(new_cnn)
