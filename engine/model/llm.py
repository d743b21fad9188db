"""Qwen3 decoder (model.md §1.2) with caller-owned, slot-indexed KV storage.

The module holds only weights. KV lives in a `SlotKVCache` ([slots + 1, kv_heads, max_len, head_dim] per
layer, the extra slot is a scratch slot for padding) that the engine allocates once. A forward takes input
embeddings for B rows of possibly different sessions, the absolute position of every query (which is also
its cache index), and the slot of every row. It writes the new K/V into the owning slot and returns the
final-norm hidden states; `logits()` applies the lm_head to the positions the caller selects.

Shapes never depend on data, so a decode step at a fixed batch bucket can be captured in a CUDA graph.
The layers shared with the TTS backbone live in layers.py; Qwen3 adds per-head q/k RMSNorm, fused
projections and the folded-GQA attention variants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LLMConfig
from engine.model.flex import KEYS_PER_SPLIT, decode_tuning, dense_blocks, slot_blocks
from engine.model.layers import (
    DecoderLayer,
    GatedMLP,
    LayerFn,
    RMSNorm,
    SlotAttention,
    SlotKVCache,
    SlotLayout,
    apply_rope,
    fuse_layers,
    layers_fused,
    linear,
    rope_cos_sin,
    rope_inv_freq,
    rotate_half,
    run_layer,
    set_gemm_rows,
    slot_layout,
    verify_one_gemm_tiles,
)

__all__ = ["Attention", "Qwen3LLM", "Qwen3Model", "RMSNorm", "SlotKVCache", "apply_rope", "rotate_half"]


# lm_head output rows padded to a multiple of this (`Qwen3LLM.fuse_projections`): with MiniCPM-o's 151,748 (not a
# multiple of 8) cuBLAS ran an sm80 GEMM, on an H100 0.452 / 0.498 / 0.638 ms at 1 / 32 / 128 rows against 0.412 /
# 0.422 / 0.437 over 151,808, the same logits at 2 rows and more (bench/RESULTS.md stop 48)
LM_HEAD_ALIGN = 64


class Attention(SlotAttention):
    """Qwen3 attention: q/k RMSNorm per head before RoPE; optional fused [q; k; v] matmul."""

    def __init__(self, cfg: LLMConfig, layer: int) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q = self.q_norm(q.view(b, t, self.n_heads, self.head_dim))
        k = self.k_norm(k.view(b, t, self.n_kv, self.head_dim))
        return q, k, v.view(b, t, self.n_kv, self.head_dim)  # [B, T, heads|kvh, D]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
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
        return out.reshape(b, self.n_heads, t, d)  # SDPA may return a non-contiguous layout on CUDA


class Qwen3Model(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(Attention(cfg, i), GatedMLP(cfg.hidden_size, cfg.intermediate_size), cfg.hidden_size,
                         cfg.rms_norm_eps)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3LLM(nn.Module):
    """Qwen3ForCausalLM weights (checkpoint keys minus `llm.`) with a slot-KV forward."""

    # grouped-query attention as kv-head-major rows (no K/V expansion); False = SDPA's enable_gqa
    fold_gqa: bool = True
    # single-token (decode) attention: "matmul" (two GEMMs over the folded rows), "sdpa", or "flex" (dense
    # layout only: FlexAttention over each row's own key blocks, engine/model/flex.py; bench_stage0 measures it)
    decode_attention: str = "matmul"
    # keys per split of the flex decoding kernel (engine/model/flex.py; 0: torch's count): single-token dense rows
    # (flex decode) and the gathered rows of up to 16 positions (unit prefills) have their own, because a split's
    # partial results scale with the rows' positions (flex.py `split_partials_bytes`)
    flex_keys_per_split: int = KEYS_PER_SPLIT
    flex_prefill_keys_per_split: int = KEYS_PER_SPLIT
    # the decoding kernel's warps and stages for unit prefills (flex.py `decode_tuning`; 0: torch's)
    flex_prefill_warps: int = 0
    flex_prefill_stages: int = 0

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.min_rows = 0  # `logits`' least GEMM rows (`pad_gemm_rows`)
        self.tile = False  # every GEMM in chunks of exactly min_rows rows (`pad_gemm_rows`)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)  # [D/2]
        self.register_buffer("lm_head_padded", None, persistent=False)  # [V rounded up, H] once fused

    def reset_rope_(self) -> None:
        """Recompute `inv_freq` in fp32 (after a meta build or a dtype cast); on the CPU, as at
        construction, so the table is bit-identical on every device."""
        self.inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta).to(self.lm_head.weight.device)

    def fuse_projections(self) -> Qwen3LLM:
        """q/k/v and gate/up as one matmul each (`fuse_layers`), and the lm_head's rows padded to a multiple of
        `LM_HEAD_ALIGN` (`_pad_lm_head`): state_dict keys and values unchanged."""
        fuse_layers(self.model.layers)
        self._pad_lm_head()
        return self

    def _pad_lm_head(self) -> None:
        """The lm_head weight as the first V rows of a zero-padded [V', H] buffer (a view: no extra memory, and a
        load_state_dict still reaches it); `logits` multiplies by the whole buffer and cuts the V logits out."""
        w = self.lm_head.weight
        v = w.shape[0]
        padded = torch.cat([w.detach(), w.new_zeros(-v % LM_HEAD_ALIGN, w.shape[1])])
        self.lm_head.weight = nn.Parameter(padded[:v], requires_grad=w.requires_grad)
        self.lm_head_padded = padded

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        # a device/dtype move would copy the parameter and the buffer apart: move the parameter alone, then pad it
        # again (the buffer is not moved only to be dropped: a 1.2 GB copy at full size)
        padded, self.lm_head_padded = self.lm_head_padded, None
        out = super()._apply(fn, recurse)
        if padded is not None:
            self._pad_lm_head()
        return out

    def pad_gemm_rows(self, rows: int, tile: bool = False) -> Qwen3LLM:
        """Every GEMM of the forward and `logits` at least `rows` rows (`layers.linear`: a row's numbers then do
        not depend on how many rows share its batch, where the kernel choice changes below `rows`). 0: off.
        tile: more rows too run as GEMMs of exactly `rows` rows (`Stage0Config.gemm_tile_rows`)."""
        set_gemm_rows(self.model.layers, rows, tile)
        self.min_rows, self.tile = rows, tile and rows > 0
        return self

    def verify_gemm_tiles(self, max_rows: int, logit_rows: int | None = None) -> tuple[int, int]:
        """With tiled GEMMs (`pad_gemm_rows(rows, tile=True)`): which row counts up to `max_rows` (the lm_head's: up
        to `logit_rows`, default the same) may run as one GEMM over every weight layout of the forward
        (`layers.verify_one_gemm_tiles`); call it before any graph capture. Returns (row counts run whole, kept in
        tiles) over the layouts checked."""
        if not self.tile:
            return 0, 0
        weights = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.qkv_weight] if attn.qkv_weight is not None else \
                [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            gate_up = [mlp.gate_up_weight] if mlp.gate_up_weight is not None else \
                [mlp.gate_proj.weight, mlp.up_proj.weight]
            weights += [*qkv, attn.o_proj.weight, *gate_up, mlp.down_proj.weight]
        head = self.lm_head.weight if self.lm_head_padded is None else self.lm_head_padded
        body = verify_one_gemm_tiles(weights, self.min_rows, max_rows)
        logits = verify_one_gemm_tiles([head], self.min_rows, max_rows if logit_rows is None else logit_rows)
        return body[0] + logits[0], body[1] + logits[1]

    @property
    def gemm_min_rows(self) -> int:
        """The least rows of the forward's GEMMs (`pad_gemm_rows`)."""
        return self.model.layers[0].mlp.min_rows

    @contextlib.contextmanager
    def gemm_rows(self, rows: int) -> Iterator[None]:
        """The forward's GEMMs at least `rows` rows inside the block (a graph set pads to its largest bucket,
        engine/stage0/graphs.py); `logits` keeps its own, and the tiling stays as set."""
        before = self.gemm_min_rows
        set_gemm_rows(self.model.layers, rows, self.tile)
        try:
            yield
        finally:
            set_gemm_rows(self.model.layers, before, self.tile)

    @property
    def fused(self) -> bool:
        return layers_fused(self.model.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, unscaled (model.md §1.2). ids [...] → [..., H]."""
        return self.model.embed_tokens(ids)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] → cos, sin [B, 1, T, D], computed in fp32 then cast (as transformers does)."""
        return rope_cos_sin(pos, self.inv_freq, dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, slot_ids: torch.Tensor | None,
                kv: SlotKVCache, valid: torch.Tensor | None = None,
                kv_limit: int | None = None, layer_fn: LayerFn | None = None, flex: bool = False,
                decode_attention: str | None = None) -> torch.Tensor:
        """One forward over ragged rows.

        x [B, T, H] input embeddings; input_pos [B, T] absolute positions = cache indices (padding: any
        value); slot_ids [B] int64, or None for the dense layout where row i is slot i (no KV gather; an
        unused row must point at a position nobody reads, e.g. `kv.reserved_pos`); valid [B, T] bool
        (None: all valid). Padded queries write to the scratch slot's position 0 and read only their own
        row. kv_limit: a static bound on the positions any query reaches (defaults to the cache length).
        layer_fn: runs each layer (`compile_layers()` for regional compilation; None: eager).
        flex: rows of the gathered layout attend with FlexAttention over the cache itself, instead of a copy of
        each row's first kv_limit positions (engine/model/flex.py); the dense layout ignores it.
        decode_attention: this call's single-token attention (None: the class's `decode_attention`).
        Returns final-norm hidden [B, T, H].
        """
        lay, mode, ctx = self._attention(input_pos, slot_ids, kv, valid, kv_limit, flex,
                                         decode_attention or self.decode_attention, x.dtype)
        cos, sin = self.rope(lay.write_pos, x.dtype)
        h, run = x, layer_fn or run_layer
        for i, layer in enumerate(self.model.layers):
            h = run(layer, h, cos, sin, kv.k[i], kv.v[i], lay.write_slot, lay.write_pos, slot_ids, ctx,
                    lay.kv_limit, mode)
        return self.model.norm(h)

    def _attention(self, pos: torch.Tensor, slot_ids: torch.Tensor | None, kv: SlotKVCache,
                   valid: torch.Tensor | None, kv_limit: int | None, flex: bool, decode_attention: str,
                   dtype: torch.dtype) -> tuple[SlotLayout, str, object]:
        """The rows' slot layout, their attention mode, and what every layer's attention shares: FlexAttention's
        blocks (gathered rows with `flex`, or single-token dense rows with flex decode attention) or the additive
        mask."""
        t = pos.shape[1]
        dense_flex = t == 1 and slot_ids is None and decode_attention == "flex"
        use_flex = (flex and slot_ids is not None) or dense_flex
        lay = slot_layout(pos, slot_ids, kv, valid, kv_limit, with_visible=not use_flex)
        if dense_flex:
            return lay, "flex", dense_blocks(lay.write_pos, kv.reserved_pos, kv.max_len,
                                             (kv.slots + 1) * self.cfg.num_key_value_heads, self.flex_keys_per_split)
        if use_flex:
            tuning = decode_tuning(self.flex_prefill_warps, self.flex_prefill_stages, pos.device)
            return lay, "flex", slot_blocks(lay.write_pos, lay.write_slot != kv.scratch, slot_ids, kv.slots + 1,
                                            kv.max_len, self.flex_prefill_keys_per_split, tuning=tuning)
        mode = "matmul" if t == 1 and decode_attention == "matmul" else "fold" if self.fold_gqa else "gqa"
        return lay, mode, self._mask(lay.visible, mode, dtype)

    def _mask(self, visible: torch.Tensor | None, mode: str, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention bias of `visible` [B, 1, T, L], built once per forward (not converted from
        bool by every layer's attention call)."""
        assert visible is not None
        b, _, t, limit = visible.shape
        if mode != "gqa":  # rows of a kv head are (group, query): the same causal row repeats per group
            g = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
            visible = visible.expand(b, g, t, limit).reshape(b, 1, g * t, limit)  # [B, 1, g T, L]
        return torch.zeros(visible.shape, dtype=torch.float32 if mode == "matmul" else dtype,
                           device=visible.device).masked_fill_(~visible, float("-inf"))

    def forward_shared(self, xu: torch.Tensor, pos_u: torch.Tensor, slots_u: torch.Tensor, valid_u: torch.Tensor,
                       xd: torch.Tensor, pos_d: torch.Tensor, kv: SlotKVCache, *, limit_u: int | None = None,
                       limit_d: int | None = None, layer_fn: LayerFn | None = None, flex: bool = False,
                       decode_attention: str | None = None) -> torch.Tensor:
        """One pass over the weights for gathered rows (xu [Bu, Tu, H] at pos_u of slots_u, valid_u: unit
        prefills) and dense single-token rows (xd [Bd, 1, H], row i = slot i, pos_d [Bd, 1]: decoded tokens):
        the projections and the MLP take all rows in one matmul, and each part attends exactly as `forward` does
        for it alone (the prefill rows with flex or the gathered copy, the token rows with the decode attention
        over the same span). So a token row's attention does not depend on whether unit rows share its pass.
        Returns the final-norm hidden states [Bu·Tu + Bd, H]: the gathered rows' queries, then the dense rows."""
        bu, tu, _ = xu.shape
        bd = xd.shape[0]
        decode_attention = decode_attention or self.decode_attention
        lay_u, mode_u, ctx_u = self._attention(pos_u, slots_u, kv, valid_u, limit_u, flex, decode_attention, xu.dtype)
        lay_d, mode_d, ctx_d = self._attention(pos_d, None, kv, None, limit_d, flex, decode_attention, xd.dtype)
        cos_u, sin_u = self.rope(lay_u.write_pos, xu.dtype)
        cos_d, sin_d = self.rope(lay_d.write_pos, xd.dtype)
        h, run = torch.cat([xu.reshape(bu * tu, -1), xd.reshape(bd, -1)])[None], layer_fn or run_layer
        for i, layer in enumerate(self.model.layers):
            h = run(layer, h, (cos_u, cos_d), (sin_u, sin_d), kv.k[i], kv.v[i], (lay_u.write_slot, lay_d.write_slot),
                    (lay_u.write_pos, lay_d.write_pos), slots_u, (ctx_u, ctx_d), (lay_u.kv_limit, lay_d.kv_limit),
                    (mode_u, mode_d))
        return self.model.norm(h)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on selected final-norm hidden states [..., H] → [..., V] in the model dtype."""
        weight = self.lm_head.weight if self.lm_head_padded is None else self.lm_head_padded
        return linear(hidden, weight, self.min_rows, self.tile)[..., :self.cfg.vocab_size]

    def rotate_keys(self, keys: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        """Move cached (post-RoPE) keys [..., L, D] back by `shift` positions (model.md §7.4).

        Rotation by angle −shift·inv_freq on every (x_i, x_{i+D/2}) pair, in fp32, stored in keys' dtype.
        """
        angle = -torch.as_tensor(shift, dtype=torch.float32, device=keys.device) * self.inv_freq
        emb = torch.cat((angle, angle), dim=-1)  # [D]
        k32 = keys.float()
        return (k32 * emb.cos() + rotate_half(k32) * emb.sin()).to(keys.dtype)
