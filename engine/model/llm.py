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
        self.register_buffer("qkv_weight", None, persistent=False)  # [(heads + 2 kvh) D, H] once fused

    def fuse(self) -> None:
        """One [q; k; v] matmul instead of three; q/k/v_proj.weight become views of it (same keys)."""
        self.qkv_weight = _fuse_into(self.q_proj, self.k_proj, self.v_proj)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        # a device/dtype move copies parameters and buffer apart: alias them again so a later
        # load_state_dict still reaches the fused weight
        out = super()._apply(fn, recurse)
        if self.qkv_weight is not None:
            self.fuse()
        return out

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SlotKVCache,
                write_slot: torch.Tensor, write_pos: torch.Tensor, slot_ids: torch.Tensor | None,
                mask: torch.Tensor, kv_limit: int, mode: str) -> torch.Tensor:
        b, t, _ = x.shape
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight).split((nq, nk, nk), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim)  # [B, T, kvh, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, heads, T, D]
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        # advanced indices around a slice: the indexed view is [B, T, kvh, D]
        k_cache[write_slot, :, write_pos] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[write_slot, :, write_pos] = v.to(v_cache.dtype)
        if slot_ids is None:  # dense: row i is slot i, a view with no copy
            keys, values = k_cache[:b, :, :kv_limit], v_cache[:b, :, :kv_limit]  # [B, kvh, L, D]
        else:
            keys, values = k_cache[slot_ids, :, :kv_limit], v_cache[slot_ids, :, :kv_limit]  # gathered
        out = self._attend(q, keys.to(q.dtype), values.to(q.dtype), mask, mode)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, nq))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                mode: str) -> torch.Tensor:
        """q [B, heads, T, D], keys/values [B, kvh, L, D], mask additive → [B, heads, T, D]."""
        b, _, t, d = q.shape
        if mode == "gqa":  # mask [B, 1, T, L]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        # query head h reads kv head h // groups: stack each group's queries as extra rows of one kv head
        # (mask [B, 1, g T, L]), so K/V are read once and never expanded to all heads
        qf = q.reshape(b, self.n_kv, (self.n_heads // self.n_kv) * t, d)  # [B, kvh, g T, D]
        if mode == "fold":
            out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
        else:  # "matmul": two batched GEMMs, parallel over keys (a fused kernel runs one block per kv head);
            # scores rounded to the model dtype, softmax in fp32, as transformers' eager attention does
            scores = torch.matmul(qf * d ** -0.5, keys.transpose(-1, -2)).float() + mask  # [B, kvh, g T, L]
            out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
        return out.view(b, self.n_heads, t, d)


def _fuse_into(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate bias-free Linear weights along the output dim; each Linear's weight becomes a view."""
    fused = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
    start = 0
    for lin in linears:
        n, grad = lin.weight.shape[0], lin.weight.requires_grad
        lin.weight = nn.Parameter(fused[start:start + n], requires_grad=grad)
        start += n
    return fused


class MLP(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2 I, H] once fused

    def fuse(self) -> None:
        self.gate_up_weight = _fuse_into(self.gate_proj, self.up_proj)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        out = super()._apply(fn, recurse)
        if self.gate_up_weight is not None:
            self.fuse()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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

    # grouped-query attention as kv-head-major rows (no K/V expansion); False = SDPA's enable_gqa
    fold_gqa: bool = True
    # single-token (decode) attention: "matmul" (two GEMMs over the folded rows) or "sdpa"
    decode_attention: str = "matmul"

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
                                             / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def fuse_projections(self) -> Qwen3LLM:
        """Load-time fusion: q/k/v and gate/up run as one matmul each. The fused weights are
        non-persistent buffers whose slices are the original parameters, so state_dict keys, values and
        load_state_dict are unchanged (and a device/dtype move keeps them aliased)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @property
    def fused(self) -> bool:
        return self.model.layers[0].mlp.gate_up_weight is not None

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
        visible = (key_idx <= write_pos[..., None])[:, None]  # [B, 1, T, L], causal within the slot
        mode = "matmul" if t == 1 and self.decode_attention == "matmul" else "fold" if self.fold_gqa else "gqa"
        if mode != "gqa":  # rows of a kv head are (group, query): the same causal row repeats per group
            g = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
            visible = visible.expand(b, g, t, kv_limit).reshape(b, 1, g * t, kv_limit)  # [B, 1, g T, L]
        # additive bias built once, not converted from bool by every layer's attention call
        mask = torch.zeros(visible.shape, dtype=torch.float32 if mode == "matmul" else x.dtype,
                           device=x.device).masked_fill_(~visible, float("-inf"))
        cos, sin = self.rope(write_pos, x.dtype)
        h = x
        for layer in self.model.layers:
            h = layer(h, cos, sin, kv, write_slot, write_pos, slot_ids, mask, kv_limit, mode)
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
