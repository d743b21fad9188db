"""Qwen3 decoder (model.md §1.2) with caller-owned, slot-indexed KV storage.

The module holds only weights. KV lives in a `SlotKVCache` ([slots + 1, kv_heads, max_len, head_dim] per
layer, the extra slot is a scratch slot for padding) that the engine allocates once. A forward takes input
embeddings for B rows of possibly different sessions, the absolute position of every query (which is also
its cache index), and the slot of every row. It writes the new K/V into the owning slot and returns the
final-norm hidden states; `logits()` applies the lm_head to the positions the caller selects.

Shapes never depend on data, so a decode step at a fixed batch bucket can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LLMConfig


@dataclass
class SlotKVCache:
    """Preallocated K/V per layer, indexed by session slot. Slot `scratch` absorbs padded writes."""

    k: list[torch.Tensor]  # per layer [slots + 1, kv_heads, max_len, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: LLMConfig, slots: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> SlotKVCache:
        shape = (slots + 1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        return cls(k=k, v=v)

    @property
    def slots(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def scratch(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def reserved_pos(self) -> int:
        """The last position of every slot is never used for tokens: idle dense rows write there."""
        return self.max_len - 1

    def bytes_per_slot(self) -> int:
        one = self.k[0][0]
        return 2 * len(self.k) * one.numel() * one.element_size()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as transformers' Qwen3RMSNorm does
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SlotKVCache,
                write_slot: torch.Tensor, write_pos: torch.Tensor, slot_ids: torch.Tensor | None,
                mask: torch.Tensor, kv_limit: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)  # [B, T, kvh, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, heads, T, D]
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        # advanced indices around a slice: the indexed view is [B, T, kvh, D]
        k_cache[write_slot, :, write_pos] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[write_slot, :, write_pos] = v.to(v_cache.dtype)
        if slot_ids is None:  # dense: row i is slot i, a view with no copy
            keys, values = k_cache[:b, :, :kv_limit], v_cache[:b, :, :kv_limit]  # [B, kvh, L, D]
        else:
            keys, values = k_cache[slot_ids, :, :kv_limit], v_cache[slot_ids, :, :kv_limit]  # gathered
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                             enable_gqa=True)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args: object) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3LLM(nn.Module):
    """Qwen3ForCausalLM weights (checkpoint keys minus `llm.`) with a slot-KV forward."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
                                             / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, unscaled (model.md §1.2). ids [...] → [..., H]."""
        return self.model.embed_tokens(ids)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] → cos, sin [B, 1, T, D], computed in fp32 then cast (as transformers does)."""
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, slot_ids: torch.Tensor | None,
                kv: SlotKVCache, valid: torch.Tensor | None = None,
                kv_limit: int | None = None) -> torch.Tensor:
        """One forward over ragged rows.

        x [B, T, H] input embeddings; input_pos [B, T] absolute positions = cache indices (padding: any
        value); slot_ids [B] int64, or None for the dense layout where row i is slot i (no KV gather; an
        unused row must point at a position nobody reads, e.g. `kv.reserved_pos`); valid [B, T] bool
        (None: all valid). Padded queries write to the scratch slot's position 0 and read only their own
        row. kv_limit: a static bound on the positions any query reaches (defaults to the cache length).
        Returns final-norm hidden [B, T, H].
        """
        b, t, _ = x.shape
        kv_limit = kv.max_len if kv_limit is None else min(kv_limit, kv.max_len)
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=x.device)
        rows = torch.arange(b, device=x.device) if slot_ids is None else slot_ids
        write_slot = torch.where(valid, rows[:, None], kv.scratch)  # [B, T]
        write_pos = torch.where(valid, input_pos, 0)
        key_idx = torch.arange(kv_limit, device=x.device)
        mask = (key_idx <= write_pos[..., None])[:, None]  # [B, 1, T, L], causal within the slot
        cos, sin = self.rope(write_pos, x.dtype)
        h = x
        for layer in self.model.layers:
            h = layer(h, cos, sin, kv, write_slot, write_pos, slot_ids, mask, kv_limit)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on selected final-norm hidden states [..., H] → [..., V] in the model dtype."""
        return self.lm_head(hidden)

    def rotate_keys(self, keys: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        """Move cached (post-RoPE) keys [..., L, D] back by `shift` positions (model.md §7.4).

        Rotation by angle −shift·inv_freq on every (x_i, x_{i+D/2}) pair, in fp32, stored in keys' dtype.
        """
        angle = -torch.as_tensor(shift, dtype=torch.float32, device=keys.device) * self.inv_freq
        emb = torch.cat((angle, angle), dim=-1)  # [D]
        k32 = keys.float()
        return (k32 * emb.cos() + rotate_half(k32) * emb.sin()).to(keys.dtype)
