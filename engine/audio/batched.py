"""The streaming Whisper encoder (model.md §2.4) for many sessions' units in one pass.

`forward_stream_batch` equals `WhisperEncoder.forward_stream` run once per session: every unit yields
the same 50 encoder frames (unit 0: T = 102, no left trim; later units: T = 104, one CNN frame trimmed
per side), so the CNN, the projections and the MLP run as one [B, 50, d] batch. Attention is one SDPA
per layer over every session's cache up to the longest past + 50, after the unit's own K/V went into it at
the session's positions; a key counts for a session below its own past + 50 (the padding mask).

Sessions whose caches are slots of one `AudioKVPool` (the front end's, engine/audio/frontend.py) are read
with one gather and written with one scatter per layer, so the ops dispatched per call do not grow with the
batch (issue 15: the per-session slicing and stacking held much of the stage0 thread at 16 sessions); any
other batch (a session beyond the pool) writes and stacks each session's cache on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.audio.framing import UnitMel
from engine.hostio import to_device
from engine.model.audio import AudioKVCache, AudioKVPool, WhisperEncoder, WhisperEncoderLayer, cnn_length


class EncoderGraphs(Protocol):
    """The captured layers `forward_stream_batch` may hand a batch to (engine/audio/graphs.py; a protocol
    here, since that module builds on this one)."""

    pool: AudioKVPool
    frames: int

    def covers(self, rows: int, span: int) -> bool: ...

    def run(self, x: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, starts: torch.Tensor, span: int,
            whole: bool = False) -> torch.Tensor: ...


def _trim(unit: UnitMel) -> tuple[int, int]:
    """(first kept CNN frame, kept count): the trim rule of `forward_stream`."""
    n = cnn_length(unit.mel.shape[-1])
    left = (unit.prefix_extra + 1) // 2 if unit.prefix_extra > 0 else 0
    right = (unit.suffix_extra + 1) // 2 if unit.suffix_extra > 0 else 0
    kept = n - left
    if 0 < right < kept:
        kept -= right
    return left, kept


class PoolKV:
    """The batch's KV in an `AudioKVPool`: one scatter writes a layer's new K/V of every session, one gather
    reads its window; the op count does not grow with the batch. When the batch's slots are one run
    (`block`, e.g. every session of a full pool), the window is a view of the pool: no copy at all (at 64
    sessions the gather copied about 0.8 GB per layer)."""

    def __init__(self, pool: AudioKVPool, slots: torch.Tensor, at: torch.Tensor, block: slice | None) -> None:
        self.pool, self.slots, self.at = pool, slots, at  # slots [B], at [B, S]: each session's new positions
        self.block = block

    def window(self, layer: int, k: torch.Tensor, v: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H, S, D] into the sessions' slots at `at`, then their first `span` positions [B, H, span, D]."""
        rows = self.slots[:, None]  # [B, 1]
        out = []
        for cache, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):  # [slots, H, cap, D]
            cache[rows, :, self.at] = new.transpose(1, 2)  # [B, S, H, D] at (slot, position)
            if self.block is not None:
                out.append(cache[self.block, :, :span])  # a view
            else:
                out.append(cache[:, :, :span].index_select(0, self.slots))  # the one copy
        return out[0], out[1]


def _run(slots: list[int]) -> slice | None:
    """slice(a, a + n) when `slots` are a, a + 1, ..., a + n - 1; else None."""
    return slice(slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) else None


class _PrivateKV:
    """The batch's KV in each session's own tensors (a session beyond the pool): per-session writes and a stack."""

    def __init__(self, caches: Sequence[AudioKVCache]) -> None:
        self.caches = caches

    def window(self, layer: int, k: torch.Tensor, v: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = k.shape[2]
        for b, c in enumerate(self.caches):
            c.k[layer, 0, :, c.length:c.length + s] = k[b]
            c.v[layer, 0, :, c.length:c.length + s] = v[b]
        return (torch.stack([c.k[layer, 0, :, :span] for c in self.caches]),  # [B, H, span, D]
                torch.stack([c.v[layer, 0, :, :span] for c in self.caches]))


def encoder_layer(layer: WhisperEncoderLayer, x: torch.Tensor, kv: PoolKV | _PrivateKV, i: int, span: int,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Encoder layer `i` over x [B, S, d]: its K/V join the sessions' caches, then it attends to their first
    `span` positions under `mask`."""
    attn = layer.self_attn
    b, s, d = x.shape
    h = layer.self_attn_layer_norm(x)
    q, k, v = attn._split(attn.q_proj(h)), attn._split(attn.k_proj(h)), attn._split(attn.v_proj(h))
    keys, values = kv.window(i, k, v, span)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, S, D]
    x = x + attn.out_proj(out.transpose(1, 2).reshape(b, s, d))
    return x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))


def forward_stream_batch(encoder: WhisperEncoder, units: Sequence[UnitMel], caches: Sequence[AudioKVCache],
                         mels: torch.Tensor | None = None, graphs: EncoderGraphs | None = None) -> torch.Tensor:
    """One unit per session -> post-LN hidden [B, S, d]; each cache advanced as `forward_stream` would.
    `mels`: the units' mel slices already stacked [B, n_mels, T_max], zero-padded on the right
    (MelStreamer.next_units); else they are stacked here. `graphs`: the layers run captured when every
    session is in their pool and a bucket covers the batch (engine/audio/graphs.py)."""
    dev = encoder.conv1.weight.device
    trims = [_trim(u) for u in units]
    s = trims[0][1]
    if any(kept != s for _, kept in trims):
        raise ValueError(f"units of different encoder lengths cannot share a batch: {[k for _, k in trims]}")
    for unit, cache in zip(units, caches, strict=True):  # the §2.4 reset rule, per session, first (host ints)
        if cache.length + cnn_length(unit.mel.shape[-1]) >= cache.capacity:
            cache.reset()
            cache.resets += 1
    lengths = [c.length for c in caches]
    pool = caches[0].pool
    if pool is not None and not pool.holds(caches):
        pool = None  # a session beyond the pool is in the batch
    rows = [lengths, [left for left, _ in trims], [c.slot if pool is not None else 0 for c in caches]]
    # every per-session index in one host -> device copy (no blocking copy: tests/engine/test_stage0_syncs.py)
    starts, lefts, slots = to_device(torch.tensor(rows), dev).unbind(0)  # [B] each
    at = starts[:, None] + torch.arange(s, device=dev)  # [B, S]: each session's new frames, positions
    x = _embed_units(encoder, units, lefts, s, mels) + encoder.embed_positions.weight[at]  # [B, S, d]
    span = max(lengths) + s  # every cache has room: the reset rule ran above
    mask = None
    if any(n + s != span for n in lengths):  # [B, 1, 1, span]: a session's own past + unit only
        mask = (torch.arange(span, device=dev)[None] < (starts + s)[:, None])[:, None, None, :]
    if graphs is not None and pool is graphs.pool and s == graphs.frames and graphs.covers(len(caches), span):
        out = graphs.run(x, slots, at, starts, span, whole=rows[2] == list(range(pool.slots)))
    else:
        kv = PoolKV(pool, slots, at, _run(rows[2])) if pool is not None else _PrivateKV(caches)
        with attention_kernels(dev):
            for i, layer in enumerate(encoder.layers):
                x = encoder_layer(layer, x, kv, i, span, mask)
        out = encoder.layer_norm(x)
    for c, n in zip(caches, lengths, strict=True):
        c.length = n + s
    return out


# Measured on the H200 (bench/RESULTS.md, stop 14; `bench/stage0_frontend.py --batches 1,16 --stagger 1,8 --sdpa
# default,no-cudnn,efficient,math`): with PyTorch's own kernel choice, 16 sessions at different units (the
# padding mask, as served) took 37.7 ms median but 1149 ms p99 per call; memory-efficient attention (math as the
# fallback) 34.8 / 37.0 ms, and 11.4 ms for one session. The served stage0 stalls of 0.9-1.6 s matched it.
CUDA_ATTENTION = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_kernels(dev: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels the encoder's attention may use on this device (CUDA: CUDA_ATTENTION; else PyTorch's)."""
    return sdpa_kernel(list(CUDA_ATTENTION)) if dev.type == "cuda" else contextlib.nullcontext()


def _embed_units(encoder: WhisperEncoder, units: Sequence[UnitMel], lefts: torch.Tensor, s: int,
                 stacked: torch.Tensor | None) -> torch.Tensor:
    """The CNN over every unit's mel, `s` frames kept from `lefts` [B] on (`forward_stream`'s trim) -> [B, S, d]."""
    dev = encoder.conv1.weight.device
    if stacked is None:
        t_max = max(u.mel.shape[-1] for u in units)
        # Right zero-padding is what conv1's own padding adds at a slice edge: the kept frames are unchanged. Only
        # a first unit (102 frames among 104) needs it.
        mels = [u.mel if u.mel.shape[-1] == t_max else F.pad(u.mel, (0, t_max - u.mel.shape[-1])) for u in units]
        stacked = torch.stack(mels)
    x = encoder.embed_cnn(to_device(stacked, dev))  # [B, n_mels, T] -> [B, ceil(T / 2), d]
    frames = lefts[:, None] + torch.arange(s, device=dev)  # [B, S]
    return x.gather(1, frames[..., None].expand(-1, -1, x.shape[-1]))  # [B, S, d]
