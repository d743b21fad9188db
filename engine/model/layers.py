"""Decoder pieces shared by the Qwen3 LLM (llm.py) and the Llama TTS backbone (tts.py).

Both backbones are pre-norm decoders with RMSNorm, rotate-half RoPE, a SiLU-gated MLP and attention
over caller-owned, slot-indexed KV (`SlotKVCache`). What differs (Qwen3's q/k norms, fused
projections, folded-GQA attention variants) lives in llm.py as overrides of `SlotAttention`.

Slot layout of one forward: B rows with T queries each; query (b, i) writes its K/V at
(slot of row b, input_pos[b, i]); a padded query writes to the scratch slot's position 0 and reads
only its own row. Keys past a query's position are stale entries of earlier units or turns, so the
mask is causal within the slot.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model.flex import flex_slot_attend


class KVDims(Protocol):
    """The config fields a KV cache is sized from (LLMConfig and TTSConfig both have them)."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass
class SlotKVCache:
    """Preallocated K/V per layer, indexed by session slot. Slot `scratch` absorbs padded writes."""

    k: list[torch.Tensor]  # per layer [slots + 1, kv_heads, max_len, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: KVDims, slots: int, max_len: int, *, dtype: torch.dtype,
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
        # fp32 statistics, cast back before the weight, as transformers' Qwen3/Llama RMSNorm do
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


# ---------------------------------------------------------------- rotary embedding (rotate-half)
def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 inverse frequencies [D/2] of the non-interleaved (rotate-half) convention."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [B, T] → cos, sin [B, 1, T, D], computed in fp32 then cast (as transformers does)."""
    freqs = pos.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------- slot layout and slot attention
class SlotLayout(NamedTuple):
    """Where each query of a forward writes and what it may read; shared by every layer.

    A NamedTuple rather than a dataclass: it is built inside torch.compile'd / graph-captured steps."""

    write_slot: torch.Tensor  # [B, T] int64 (scratch for padded queries)
    write_pos: torch.Tensor   # [B, T] int64 (0 for padded queries)
    visible: torch.Tensor | None  # [B, 1, T, L] bool, causal within the slot (None: not asked for)
    kv_limit: int             # L: static bound on the keys attended


def slot_layout(input_pos: torch.Tensor, slot_ids: torch.Tensor | None, kv: SlotKVCache,
                valid: torch.Tensor | None, kv_limit: int | None, with_visible: bool = True) -> SlotLayout:
    """input_pos [B, T]; slot_ids [B] or None (dense: row i is slot i); valid [B, T] bool or None.
    with_visible=False skips the [B, 1, T, L] mask (FlexAttention builds its own from the positions)."""
    b, t = input_pos.shape
    device = input_pos.device
    kv_limit = kv.max_len if kv_limit is None else min(kv_limit, kv.max_len)
    if valid is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device) if slot_ids is None else slot_ids
    write_slot = torch.where(valid, rows[:, None], kv.scratch)  # [B, T]
    write_pos = torch.where(valid, input_pos, 0)
    visible = None
    if with_visible:
        key_idx = torch.arange(kv_limit, device=device)
        visible = (key_idx <= write_pos[..., None])[:, None]  # [B, 1, T, L]
    return SlotLayout(write_slot, write_pos, visible, kv_limit)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             write_slot: torch.Tensor, write_pos: torch.Tensor) -> None:
    """Store k [B, kvh, T, D] and v [B, T, kvh, D] into one layer's caches [S + 1, kvh, max_len, D]."""
    # advanced indices around a slice: the indexed view is [B, T, kvh, D]
    k_cache[write_slot, :, write_pos] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[write_slot, :, write_pos] = v.to(v_cache.dtype)


def write_and_read_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      write_slot: torch.Tensor, write_pos: torch.Tensor, slot_ids: torch.Tensor | None,
                      kv_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store k [B, kvh, T, D] and v [B, T, kvh, D] into one layer's caches [S + 1, kvh, max_len, D],
    then return the rows' keys and values [B, kvh, L, D] (the new entries included)."""
    b = k.shape[0]
    write_kv(k_cache, v_cache, k, v, write_slot, write_pos)
    if slot_ids is None:  # dense: row i is slot i, a view with no copy
        return k_cache[:b, :, :kv_limit], v_cache[:b, :, :kv_limit]
    return k_cache[slot_ids, :, :kv_limit], v_cache[slot_ids, :, :kv_limit]  # gathered


def linear(x: torch.Tensor, weight: torch.Tensor, min_rows: int = 0, tile: bool = False,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over x [..., K] with at least `min_rows` rows in the GEMM: fewer rows are padded with zeros and
    the result cut back. cuBLAS picks its kernel by the row count, so a row's result can depend on how many rows
    share its GEMM (on the H200 in bf16 the lm_head's did; bench/RESULTS.md stop 36). A row's result does not
    depend on the other rows' values, so with every count below `min_rows` run as `min_rows` rows it does not
    depend on how many sessions share the step (counts above keep their own kernel: on the H200 the lm_head's 32
    and 64 rows matched).

    tile: counts above `min_rows` run too as GEMMs of exactly `min_rows` rows, one per chunk (the last padded), so
    no count picks another kernel. The TTS needs it: its unit prefill runs sessions x text rows, past any padding
    (bench/RESULTS.md stop 38)."""
    rows = x.numel() // x.shape[-1]
    if not min_rows or rows == min_rows or (rows > min_rows and not tile):
        return F.linear(x, weight, bias)
    if rows > min_rows:
        return tiled_linear(x, weight, bias, min_rows)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, min_rows - rows))
    return F.linear(flat, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


# Whether one GEMM over `rows` rows (a multiple of the tile) gave, on this process's device, bit for bit the result of
# its `tile`-row GEMMs, per weight layout: `verify_one_gemm_tiles` fills it, `tiled_linear` then runs such a GEMM
# whole, reading the weight once instead of once per tile. cuBLAS names other kernels for other row counts, yet on an
# H100 every LLM weight at 256-1024 rows gave the tiles' bits, 2-2.4x sooner (bench/bench_gemm_tiles.py, stop 50);
# where a device's choice differs the tiles stay, so a row's numbers never depend on what shares its step.
_ONE_GEMM: dict[tuple, bool] = {}
_VERIFIED_WEIGHTS: set[int] = set()  # the data pointers of the weights checked (others keep the tiles)


def _one_gemm_key(weight: torch.Tensor, tile: int, rows: int) -> tuple:
    # what cuBLAS picks a kernel by, beside the rows: the weight's shape, strides, dtype, device and alignment
    return (tuple(weight.shape), weight.stride(), weight.dtype, str(weight.device), weight.data_ptr() % 256, tile,
            rows)


def gemm_tiles(x: torch.Tensor, weight: torch.Tensor, tile: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K], rows a multiple of `tile`, through one GEMM of exactly `tile` rows per chunk."""
    return torch.cat([F.linear(chunk, weight, bias) for chunk in x.split(tile)])


@torch.no_grad()
def verify_one_gemm_tiles(weights: list[torch.Tensor], tile: int, max_rows: int, seed: int = 0) -> tuple[int, int]:
    """For each weight's layout and each multiple of `tile` past it up to `max_rows` rounded up to the tile (what a
    step of `max_rows` rows is padded to): whether one GEMM over a seeded random
    input gives the tiles' bits (`tiled_linear` runs it whole from then on, for these weights only; a layout is
    checked once). Before any graph capture: the capture records whichever way it finds. Returns (row counts run
    whole, kept in tiles), over the layouts checked now."""
    whole = tiled = 0
    for w in weights:
        _VERIFIED_WEIGHTS.add(w.data_ptr())
        for rows in range(2 * tile, -(-max_rows // tile) * tile + 1, tile):
            key = _one_gemm_key(w, tile, rows)
            if key in _ONE_GEMM:
                continue
            g = torch.Generator(device=w.device).manual_seed(seed)
            x = torch.randn(rows, w.shape[1], generator=g, device=w.device, dtype=w.dtype)
            same = torch.equal(F.linear(x, w), gemm_tiles(x, w, tile))
            _ONE_GEMM[key] = same
            whole, tiled = whole + same, tiled + (not same)
    return whole, tiled


@torch.library.custom_op("duplex::tiled_linear", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias, int tile) -> Tensor")
def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """x [..., K] through GEMMs of exactly `tile` rows each (the last chunk zero-padded), or through one GEMM over the
    padded rows where `verify_one_gemm_tiles` found it gives the same bits. An opaque op to torch.compile: a loop over
    a symbolic row count would recompile the compiled layer for every chunk count."""
    rows = x.numel() // x.shape[-1]
    padded = -(-rows // tile) * tile
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    if bias is None and weight.data_ptr() in _VERIFIED_WEIGHTS and _ONE_GEMM.get(_one_gemm_key(weight, tile, padded)):
        out = F.linear(flat, weight)
    else:
        out = gemm_tiles(flat, weight, tile, bias)
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


@tiled_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class SlotAttention(nn.Module):
    """Bias-free q/k/v/o attention with RoPE over slot KV. Subclasses may override `project`
    (how q, k, v are computed) and `attend` (the attention kernel); the default is one SDPA call.
    `fuse()` makes q/k/v one matmul (same keys and values)."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.register_buffer("qkv_weight", None, persistent=False)  # [(heads + 2 kvh) D, H] once fused
        self.min_rows = 0  # the projections' least GEMM rows (`linear`); set by the model's `pad_gemm_rows`
        self.tile = False  # and more rows in chunks of min_rows (`linear`'s tile; the TTS's `tile_gemm_rows`)
        self.sdpa_backends: tuple[SDPBackend, ...] | None = None  # `attend`'s SDPA kernels (None: torch's choice)

    def fuse(self) -> None:
        """One [q; k; v] matmul instead of three; q/k/v_proj.weight become views of it (same keys)."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        # a device/dtype move copies parameters and buffer apart: alias them again so a later
        # load_state_dict still reaches the fused weight
        out = super()._apply(fn, recurse)
        if self.qkv_weight is not None:
            self.fuse()
        return out

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] → q [B, T, heads D], k, v [B, T, kvh D]: one matmul once fused, else three."""
        if self.qkv_weight is None:
            return tuple(linear(x, p.weight, self.min_rows, self.tile)
                         for p in (self.q_proj, self.k_proj, self.v_proj))
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = linear(x, self.qkv_weight, self.min_rows, self.tile).split((nq, nk, nk), dim=-1)
        return q, k, v

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] → q [B, T, heads, D], k, v [B, T, kvh, D]."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        return (q.view(b, t, self.n_heads, self.head_dim), k.view(b, t, self.n_kv, self.head_dim),
                v.view(b, t, self.n_kv, self.head_dim))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               mode: str) -> torch.Tensor:
        """q [B, heads, T, D], keys/values [B, kvh, L, D], mask [B, 1, T, L] → [B, heads, T, D]."""
        kernels = nullcontext() if self.sdpa_backends is None else sdpa_kernel(list(self.sdpa_backends))
        with kernels:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=self.n_kv != self.n_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_slot: torch.Tensor, write_pos: torch.Tensor,
                slot_ids: torch.Tensor | None, mask: torch.Tensor, kv_limit: int, mode: str = "sdpa") -> torch.Tensor:
        """k_cache, v_cache: this layer's `SlotKVCache` tensors. Passed in rather than looked up by
        `self.layer`, so every layer runs the same code with no per-layer constant (`run_layer`).

        A tuple `mode` is a shared pass (`Qwen3LLM.forward_shared`): x [1, M, H] holds the Bu x Tu queries of
        gathered rows, then the Bd rows of the dense layout; every tuple argument is (gathered, dense). The
        projections see all M rows at once, each part attends as it would alone."""
        if isinstance(mode, tuple):
            return self._shared(x, cos, sin, k_cache, v_cache, write_slot, write_pos, slot_ids, mask, kv_limit, mode)
        b, t, _ = x.shape
        q, k, v = self.project(x)
        out = self._attend_rows(q, k, v, cos, sin, k_cache, v_cache, write_slot, write_pos, slot_ids, mask,
                                kv_limit, mode)
        return linear(out.reshape(b, t, self.n_heads * self.head_dim), self.o_proj.weight, self.min_rows, self.tile)

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, write_slot: torch.Tensor, write_pos: torch.Tensor,
                     slot_ids: torch.Tensor | None, mask: torch.Tensor, kv_limit: int, mode: str) -> torch.Tensor:
        """q [B, T, heads, D], k, v [B, T, kvh, D] → [B, T, heads, D]; the rows' K/V written first."""
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, heads, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, kvh, T, D]
        if mode == "flex":  # over the caches themselves, no gathered copy (mask: the forward's SlotBlocks)
            write_kv(k_cache, v_cache, k, v, write_slot, write_pos)
            out = flex_slot_attend(q, k_cache, v_cache, mask)  # type: ignore[arg-type]
        else:
            keys, values = write_and_read_kv(k_cache, v_cache, k, v, write_slot, write_pos, slot_ids, kv_limit)
            out = self.attend(q, keys.to(q.dtype), values.to(q.dtype), mask, mode)  # [B, heads, T, D]
        return out.transpose(1, 2)

    def _shared(self, x: torch.Tensor, cos: tuple, sin: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor,
                write_slot: tuple, write_pos: tuple, slot_ids: torch.Tensor | None, mask: tuple, kv_limit: tuple,
                mode: tuple) -> torch.Tensor:
        bu, tu, bd = cos[0].shape[0], cos[0].shape[2], cos[1].shape[0]
        n = bu * tu
        q, k, v = self.project(x)  # [1, M, heads | kvh, D]

        def part(lo: int, hi: int, b: int, t: int, i: int, slots: torch.Tensor | None) -> torch.Tensor:
            out = self._attend_rows(q[0, lo:hi].reshape(b, t, *q.shape[2:]), k[0, lo:hi].reshape(b, t, *k.shape[2:]),
                                    v[0, lo:hi].reshape(b, t, *v.shape[2:]), cos[i], sin[i], k_cache, v_cache,
                                    write_slot[i], write_pos[i], slots, mask[i], kv_limit[i], mode[i])
            return out.reshape(b * t, self.n_heads * self.head_dim)

        # two calls, not a loop: flex decode rows leave the compiled layer for their kernel (flex.py
        # `dense_flex_decode`), and dynamo skips a whole frame whose graph break sits in a loop
        parts = [part(0, n, bu, tu, 0, slot_ids), part(n, n + bd, bd, 1, 1, None)]
        return linear(torch.cat(parts)[None], self.o_proj.weight, self.min_rows, self.tile)


# ---------------------------------------------------------------- MLP and the decoder layer
def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate bias-free Linear weights along the output dim; each Linear's weight becomes a view."""
    fused = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
    start = 0
    for lin in linears:
        n, grad = lin.weight.shape[0], lin.weight.requires_grad
        lin.weight = nn.Parameter(fused[start:start + n], requires_grad=grad)
        start += n
    return fused


class GatedMLP(nn.Module):
    """down(SiLU(gate(x)) · up(x)); `fuse()` makes gate/up one matmul (same keys and values)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2 I, H] once fused
        self.min_rows = 0  # least GEMM rows (`linear`)
        self.tile = False  # more rows in chunks of min_rows (`linear`)

    def fuse(self) -> None:
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module signature
        # a device/dtype move copies parameters and buffer apart: alias them again
        out = super()._apply(fn, recurse)
        if self.gate_up_weight is not None:
            self.fuse()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            gate, up = linear(x, self.gate_proj.weight, self.min_rows, self.tile), \
                linear(x, self.up_proj.weight, self.min_rows, self.tile)
        else:
            gate, up = linear(x, self.gate_up_weight, self.min_rows, self.tile).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight, self.min_rows, self.tile)


def fuse_layers(layers: nn.ModuleList) -> None:
    """Load-time fusion of every decoder layer: q/k/v and gate/up as one matmul each. The fused weights are
    non-persistent buffers whose slices are the original parameters, so state_dict keys, values and
    load_state_dict are unchanged (and a device/dtype move keeps them aliased)."""
    for layer in layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()


def layers_fused(layers: nn.ModuleList) -> bool:
    return layers[0].mlp.gate_up_weight is not None


def set_gemm_rows(layers: nn.ModuleList, rows: int, tile: bool = False) -> None:
    """The least rows of every decoder layer's GEMMs (`linear`; 0: off); tile: more rows in chunks of that many."""
    for layer in layers:
        layer.self_attn.min_rows = layer.mlp.min_rows = rows
        layer.self_attn.tile = layer.mlp.tile = tile


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, *attn_args: object) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------- regional compilation
# How a forward runs one layer: `run_layer` (eager) or a torch.compile of it (`compile_layers`).
LayerFn = Callable[..., torch.Tensor]


def run_layer(layer: nn.Module, *args: object) -> torch.Tensor:
    """layer(*args). The unit of regional compilation: every decoder layer of a model runs this one code
    object with its own weights and caches as inputs, so dynamo and inductor compile one layer once for
    all layers (not a whole unrolled forward per shape)."""
    return layer(*args)


def mark_static_kv(kv: SlotKVCache) -> None:
    """Tell dynamo the cache tensors never change size (with dynamic=True their sizes would be symbols too:
    more guards, and kernels that index the cache with symbolic strides)."""
    import torch._dynamo

    for t in (*kv.k, *kv.v):
        torch._dynamo.mark_static(t)


def allow_recompiles(limit: int) -> None:
    """Room for the compiled layer's few shapes (and another engine's in the same process): raise
    dynamo's per-function recompile cap.

    NOTE: dynamo's config is process-global; this only ever raises the cap.
    """
    import torch._dynamo

    conf = torch._dynamo.config
    name = "recompile_limit" if hasattr(conf, "recompile_limit") else "cache_size_limit"
    setattr(conf, name, max(getattr(conf, name), limit))


def compile_symbolic(fn: Callable[..., torch.Tensor], mode: str | None = None,
                     dynamic: bool | None = True, eager_rounding: bool = False) -> Callable[..., torch.Tensor]:
    """torch.compile(fn) for a few compiles over many shape buckets. dynamic=True: every size (batch,
    query length, the attended-key span kv_limit) is symbolic from the first compile (sizes 0 and 1 still
    specialise: a batch-1 shape compiles once more). Traced without duck shaping, which gives equal sizes
    one symbol: a batch equal to the head dim or to heads x length would pin the batch to that value.

    eager_rounding: inductor rounds each fused kernel's intermediates to the model dtype as eager does
    (`emulate_precision_casts`). Without it a value's rounding follows the fusion, and the fusion follows the
    traced graph: the same decode row read other bits in a shared pass than in its decode graph (H100,
    bench/RESULTS.md stop 45)."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(fn, mode=mode, dynamic=dynamic)

    def call(*args: object) -> torch.Tensor:
        with fx_config.patch(use_duck_shape=False):
            if not eager_rounding:  # the TTS and Token2Wav compiles: no second config patch per layer call
                return compiled(*args)
            with inductor_config.patch(emulate_precision_casts=True):
                return compiled(*args)
    return call


def compile_layers(mode: str | None = None, dynamic: bool | None = True, eager_rounding: bool = False) -> LayerFn:
    """Regional compilation: `run_layer` compiled once for all layers (`compile_symbolic`)."""
    return compile_symbolic(run_layer, mode, dynamic, eager_rounding)
