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

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from engine.config import TTSConfig
from engine.model.layers import (
    DecoderLayer,
    GatedMLP,
    LayerFn,
    RMSNorm,
    SlotAttention,
    SlotKVCache,
    fuse_layers,
    layers_fused,
    linear,
    rope_cos_sin,
    rope_inv_freq,
    run_layer,
    set_gemm_rows,
    slot_layout,
)

# The TTS cache has the LLM cache's layout; the name stays for callers that size it from a TTSConfig.
TTSKVCache = SlotKVCache


# SDPA kernels of the TTS attention: cuDNN's is left out, its result for a row depended on the batch on the H200
NO_CUDNN_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class LlamaBackbone(nn.Module):
    """`tts.model.*` without `embed_tokens` (the TTS is driven by inputs_embeds only)."""

    def __init__(self, cfg: TTSConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layers = nn.ModuleList(
            DecoderLayer(SlotAttention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i),
                         GatedMLP(h, cfg.intermediate_size), h, eps)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SemanticProjector(nn.Module):
    """Linear(llm_dim → hidden, bias) → ReLU → Linear(hidden → hidden, bias) (model.md §1.5)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)
        self.tile_rows = 0  # GEMMs of exactly this many rows (`linear`'s tile; `TTSModel.tile_gemm_rows`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.tile_rows
        hidden = F.relu(linear(x, self.linear1.weight, n, True, self.linear1.bias))
        return linear(hidden, self.linear2.weight, n, True, self.linear2.bias)


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
        self.min_rows = 0  # `logits`' GEMM rows (`tile_gemm_rows`)

    def _inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        return rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, device)

    def reset_rope_(self) -> None:
        """Recompute `inv_freq` in fp32 (after `to_empty` from a meta build or a dtype cast); on the CPU,
        as at construction, so the table is bit-identical on every device."""
        self.inv_freq = self._inv_freq().to(self.emb_text.weight.device)

    def fuse_projections(self) -> TTSModel:
        """q/k/v and gate/up as one matmul each (`fuse_layers`): fewer kernels in the latency-bound step."""
        fuse_layers(self.model.layers)
        return self

    @property
    def fused(self) -> bool:
        return layers_fused(self.model.layers)

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
        return rope_cos_sin(pos, inv_freq, dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, slot_ids: torch.Tensor,
                kv: TTSKVCache, valid: torch.Tensor | None = None,
                kv_limit: int | None = None, layer_fn: LayerFn | None = None) -> torch.Tensor:
        """One backbone forward over ragged rows.

        x [B, T, H] input embeddings; input_pos [B, T] absolute positions = cache indices (padding: any
        value); slot_ids [B] int64; valid [B, T] bool (None: all valid). Padded queries write to the
        scratch slot and attend to position 0 only. kv_limit: a static bound (> every valid position) on
        the keys attended (defaults to the cache length). layer_fn: runs each layer (`compile_layers()`
        for regional compilation; None: eager). Returns final-norm hidden [B, T, H].
        """
        lay = slot_layout(input_pos, slot_ids, kv, valid, kv_limit)
        cos, sin = self.rope(lay.write_pos, x.dtype)
        h, run = x, layer_fn or run_layer
        for i, layer in enumerate(self.model.layers):  # bool mask [B, 1, T, L] straight to SDPA
            h = run(layer, h, cos, sin, kv.k[i], kv.v[i], lay.write_slot, lay.write_pos, slot_ids, lay.visible,
                    lay.kv_limit)
        return self.model.norm(h)

    def tile_gemm_rows(self, rows: int) -> TTSModel:
        """Every GEMM of the projector, the backbone and `logits` on exactly `rows` rows: fewer padded, more in
        chunks (`layers.linear`'s tile). cuBLAS picks its kernel by the row count, and the TTS's unit prefill runs
        sessions x text rows, past any fixed padding: on the H200 a session's codes then differed from 8 sessions
        on (bench/RESULTS.md stop 38). With tiles the attention also leaves cuDNN's SDPA kernel out: with it a
        session's codes among 32 others still differed. 0: off, and torch's kernel choice (served at 16 sessions a
        TTS step took 74 ms without cuDNN's kernel, 62-63 at a commit with it; stop 39)."""
        set_gemm_rows(self.model.layers, rows, tile=True)
        self.projector_semantic.tile_rows = self.min_rows = rows
        for layer in self.model.layers:
            layer.self_attn.sdpa_backends = NO_CUDNN_SDPA if rows else None
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """head_code on final-norm hidden [..., H] → fp32 logits [..., num_audio_tokens] (§1.5)."""
        return linear(hidden, self.head_code[0].weight, self.min_rows, True).float()
