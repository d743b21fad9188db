"""MiniCPM-o 4.5 speech-token decoder (TTS, model.md §1.5, §5) with caller-owned slot KV.

The module holds only weights, under the checkpoint keys minus `tts.` (weight norm of `head_code.0`
already fused by the loader; `model.embed_tokens` and `projector_spk` are not held: the duplex path
never reads them). The backbone is a plain Llama (RoPE, RMSNorm, SiLU MLP, MHA, no biases) driven by
input embeddings only.

KV lives in a `TTSKVCache` ([slots + 1, kv_heads, max_len, head_dim] per layer; the extra slot is a
scratch slot that absorbs padded writes) which the engine allocates once. A forward takes B rows of
possibly different sessions, the absolute position of every query (also its cache index) and each
row's slot; shapes never depend on data, so the single-code step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TTSConfig


@dataclass
class TTSKVCache:
    """Preallocated K/V per layer, indexed by session slot. Slot `scratch` absorbs padded writes."""

    k: list[torch.Tensor]  # per layer [slots + 1, kv_heads, max_len, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: TTSConfig, slots: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> TTSKVCache:
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

    def bytes_per_slot(self) -> int:
        one = self.k[0][0]
        return 2 * len(self.k) * one.numel() * one.element_size()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, cast back before the weight, as transformers' LlamaRMSNorm does
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TTSConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                  cfg.head_dim)
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: TTSKVCache,
                write_slot: torch.Tensor, write_pos: torch.Tensor, slot_ids: torch.Tensor,
                mask: torch.Tensor, kv_limit: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)  # [B, T, kvh, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        # advanced indices around a slice: the indexed view is [B, T, kvh, D]
        k_cache[write_slot, :, write_pos] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[write_slot, :, write_pos] = v.to(v_cache.dtype)
        keys = k_cache[slot_ids, :, :kv_limit]  # [B, kvh, L, D]
        values = v_cache[slot_ids, :, :kv_limit]
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                             enable_gqa=self.n_kv != self.n_heads)  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: TTSConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TTSConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args: object) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """`tts.model.*` without `embed_tokens` (the TTS is driven by inputs_embeds only)."""

    def __init__(self, cfg: TTSConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SemanticProjector(nn.Module):
    """Linear(llm_dim → hidden, bias) → ReLU → Linear(hidden → hidden, bias) (model.md §1.5)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


class TTSModel(nn.Module):
    """Speech-token decoder weights (checkpoint keys minus `tts.`) with a slot-KV forward."""

    def __init__(self, cfg: TTSConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.emb_text = nn.Embedding(cfg.num_text_tokens, h)
        self.emb_code = nn.ModuleList(nn.Embedding(cfg.num_audio_tokens, h) for _ in range(cfg.num_vq))
        self.head_code = nn.ModuleList(nn.Linear(h, cfg.num_audio_tokens, bias=False)
                                       for _ in range(cfg.num_vq))
        self.projector_semantic = SemanticProjector(cfg.llm_dim, h)
        self.model = LlamaBackbone(cfg)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)  # [D/2]

    def _inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        d = self.cfg.head_dim
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device)
                                              / d))

    def reset_rope_(self) -> None:
        """Recompute `inv_freq` in fp32 (after `to_empty` from a meta build or a dtype cast)."""
        self.inv_freq = self._inv_freq(self.emb_text.weight.device)

    def condition(self, text_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Condition rows cond_i = emb_text(t_i) + L2normalize(projector_semantic(h_i)) (§5.1).

        text_ids [..., n] int64, hidden [..., n, llm_dim] (the LLM state at t_i's own position) →
        [..., n, H]. `audio_bos` is not appended here; see `audio_bos_row`.
        """
        proj = self.projector_semantic(hidden.to(self.emb_text.weight.dtype))
        if self.cfg.normalize_projected_hidden:
            proj = F.normalize(proj, p=2, dim=-1)
        return self.emb_text(text_ids) + proj

    def audio_bos_row(self) -> torch.Tensor:
        """emb_text(audio_bos_token_id) [H]: the last condition row of every unit."""
        return self.emb_text.weight[self.cfg.audio_bos_token_id]

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [...] int64 in [0, num_audio_tokens) → [..., H]."""
        return self.emb_code[0](codes)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] → cos, sin [B, 1, T, D], computed in fp32 then cast (as transformers does)."""
        # NOTE: a whole-model `.to(bf16)` also casts this buffer; recompute rather than rotate coarsely
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(pos.device)
        freqs = pos.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, slot_ids: torch.Tensor,
                kv: TTSKVCache, valid: torch.Tensor | None = None,
                kv_limit: int | None = None) -> torch.Tensor:
        """One backbone forward over ragged rows.

        x [B, T, H] input embeddings; input_pos [B, T] absolute positions = cache indices (padding: any
        value); slot_ids [B] int64; valid [B, T] bool (None: all valid). Padded queries write to the
        scratch slot and attend to position 0 only. kv_limit: a static bound (> every valid position) on
        the keys attended (defaults to the cache length). Returns final-norm hidden [B, T, H].
        """
        b, t, _ = x.shape
        kv_limit = kv.max_len if kv_limit is None else kv_limit
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=x.device)
        write_slot = torch.where(valid, slot_ids[:, None], kv.scratch)  # [B, T]
        write_pos = torch.where(valid, input_pos, 0)
        key_idx = torch.arange(kv_limit, device=x.device)
        # causal within the slot: keys past a query's position are stale entries of earlier units/turns
        mask = (key_idx <= write_pos[..., None])[:, None]  # [B, 1, T, L]
        cos, sin = self.rope(write_pos, x.dtype)
        h = x
        for layer in self.model.layers:
            h = layer(h, cos, sin, kv, write_slot, write_pos, slot_ids, mask, kv_limit)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """head_code on final-norm hidden [..., H] → fp32 logits [..., num_audio_tokens] (§1.5)."""
        return self.head_code[0](hidden).float()
