"""The streaming Whisper encoder (model.md §2.4) for many sessions' units in one pass.

`forward_stream_batch` equals `WhisperEncoder.forward_stream` run once per session: every unit yields
the same 50 encoder frames (unit 0: T = 102, no left trim; later units: T = 104, one CNN frame trimmed
per side), so the CNN, the projections and the MLP run as one [B, 50, d] batch. Attention is one SDPA
per layer over a stack of each session's cache up to the longest past + 50, into which the unit's own
K/V are scattered at the session's positions (one copy of the caches per layer, one small scatter); a key
counts for a session below its own past + 50. The new K/V of every layer go back into each session's
cache once, at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.audio.framing import UnitMel
from engine.hostio import to_device
from engine.model.audio import AudioKVCache, WhisperEncoder, WhisperEncoderLayer, cnn_length


def _trim(unit: UnitMel) -> tuple[int, int]:
    """(first kept CNN frame, kept count): the trim rule of `forward_stream`."""
    n = cnn_length(unit.mel.shape[-1])
    left = (unit.prefix_extra + 1) // 2 if unit.prefix_extra > 0 else 0
    right = (unit.suffix_extra + 1) // 2 if unit.suffix_extra > 0 else 0
    kept = n - left
    if 0 < right < kept:
        kept -= right
    return left, kept


def _layer(layer: WhisperEncoderLayer, x: torch.Tensor, window: tuple[torch.Tensor, torch.Tensor],
           at: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One encoder layer over x [B, S, d]: its K/V go into `window` [B, H, P + S, D] at positions `at`
    [B, S], then it attends to the window under `mask`."""
    attn = layer.self_attn
    b, s, d = x.shape
    h = layer.self_attn_layer_norm(x)
    q, k, v = attn._split(attn.q_proj(h)), attn._split(attn.k_proj(h)), attn._split(attn.v_proj(h))
    rows = torch.arange(b, device=x.device)[:, None]  # [B, 1]
    keys, values = window
    keys[rows, :, at] = k.transpose(1, 2)  # [B, S, H, D] at (row, position)
    values[rows, :, at] = v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, S, D]
    x = x + attn.out_proj(out.transpose(1, 2).reshape(b, s, d))
    x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    return x, k, v


def forward_stream_batch(encoder: WhisperEncoder, units: Sequence[UnitMel],
                         caches: Sequence[AudioKVCache]) -> torch.Tensor:
    """One unit per session -> post-LN hidden [B, S, d]; each cache advanced as `forward_stream` would."""
    dev = encoder.conv1.weight.device
    for unit, cache in zip(units, caches, strict=True):  # the §2.4 reset rule, per session, first
        if cache.length + cnn_length(unit.mel.shape[-1]) >= cache.capacity:
            cache.reset()
            cache.resets += 1
    x = _embed_units(encoder, units)  # [B, S, d]
    s = x.shape[1]
    starts = to_device(torch.tensor([c.length for c in caches]), dev)  # no blocking copy (tests/engine/test_stage0_syncs.py)
    at = starts[:, None] + torch.arange(s, device=dev)  # [B, S]: each session's new frames, positions
    x = x + encoder.embed_positions.weight[at]
    span = max(c.length for c in caches) + s  # every cache has room: the reset rule ran above
    mask = None
    if any(c.length + s != span for c in caches):  # [B, 1, 1, P + S]: a session's own past + unit only
        mask = (torch.arange(span, device=dev)[None] < (starts + s)[:, None])[:, None, None, :]
    new_k, new_v = [], []
    with _attention_kernels(dev):
        for i, layer in enumerate(encoder.layers):
            window = (torch.stack([c.k[i, 0, :, :span] for c in caches]),  # [B, H, P + S, D]: the one copy
                      torch.stack([c.v[i, 0, :, :span] for c in caches]))
            x, k, v = _layer(layer, x, window, at, mask)
            new_k.append(k)
            new_v.append(v)
    _append(caches, torch.stack(new_k), torch.stack(new_v))
    return encoder.layer_norm(x)


# Measured on the H200 (bench/RESULTS.md, stop 14; `bench/stage0_frontend.py --batches 1,16 --stagger 1,8 --sdpa
# default,no-cudnn,efficient,math`): with PyTorch's own kernel choice, 16 sessions at different units (the
# padding mask, as served) took 37.7 ms median but 1149 ms p99 per call; memory-efficient attention (math as the
# fallback) 34.8 / 37.0 ms, and 11.4 ms for one session. The served stage0 stalls of 0.9-1.6 s matched it.
CUDA_ATTENTION = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def _attention_kernels(dev: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels the encoder's attention may use on this device (CUDA: CUDA_ATTENTION; else PyTorch's)."""
    return sdpa_kernel(list(CUDA_ATTENTION)) if dev.type == "cuda" else contextlib.nullcontext()


def _embed_units(encoder: WhisperEncoder, units: Sequence[UnitMel]) -> torch.Tensor:
    """The CNN over every unit's mel, trimmed as `forward_stream` trims -> [B, S, d] (S equal for all)."""
    dev = encoder.conv1.weight.device
    trims = [_trim(u) for u in units]
    s = trims[0][1]
    if any(kept != s for _, kept in trims):
        raise ValueError(f"units of different encoder lengths cannot share a batch: {[k for _, k in trims]}")
    t_max = max(u.mel.shape[-1] for u in units)
    # Right zero-padding is what conv1's own padding adds at a slice edge: the kept frames are unchanged.
    mel = torch.stack([F.pad(to_device(u.mel, dev), (0, t_max - u.mel.shape[-1])) for u in units])  # [B, n_mels, T]
    x = encoder.embed_cnn(mel)  # [B, ceil(T / 2), d]
    frames = to_device(torch.tensor([left for left, _ in trims]), dev)[:, None] + torch.arange(s, device=dev)
    return x.gather(1, frames[..., None].expand(-1, -1, x.shape[-1]))  # [B, S, d]


def _append(caches: Sequence[AudioKVCache], k_all: torch.Tensor, v_all: torch.Tensor) -> None:
    """Every layer's new K/V [layers, B, H, S, D] into each session's cache, after its past."""
    s = k_all.shape[3]
    for b, cache in enumerate(caches):
        start = cache.length
        cache.k[:, 0, :, start:start + s] = k_all[:, b]
        cache.v[:, 0, :, start:start + s] = v_all[:, b]
        cache.length = start + s
