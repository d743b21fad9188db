"""The streaming Whisper encoder (model.md §2.4) for many sessions' units in one pass.

`forward_stream_batch` equals `WhisperEncoder.forward_stream` run once per session: every unit yields
the same 50 encoder frames (unit 0: T = 102, no left trim; later units: T = 104, one CNN frame trimmed
per side), so the CNN, the projections and the MLP run as one [B, 50, d] batch. Attention is one SDPA
over each session's past K/V (stacked up to the longest past, the rest masked) followed by the unit's
own 50 keys; the new K/V of every layer is written back into each session's cache once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.audio.framing import UnitMel
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


def _layer(layer: WhisperEncoderLayer, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One encoder layer over x [B, S, d] attending to past [B, H, P, D] (masked) + its own S keys."""
    attn = layer.self_attn
    b, s, d = x.shape
    h = layer.self_attn_layer_norm(x)
    q, k, v = attn._split(attn.q_proj(h)), attn._split(attn.k_proj(h)), attn._split(attn.v_proj(h))
    keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, S, D]
    x = x + attn.out_proj(out.transpose(1, 2).reshape(b, s, d))
    x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    return x, k, v


def forward_stream_batch(encoder: WhisperEncoder, units: Sequence[UnitMel],
                         caches: Sequence[AudioKVCache]) -> torch.Tensor:
    """One unit per session -> post-LN hidden [B, S, d]; each cache advanced as `forward_stream` would."""
    weight = encoder.conv1.weight
    dev = weight.device
    for unit, cache in zip(units, caches, strict=True):  # the §2.4 reset rule, per session, first
        if cache.length + cnn_length(unit.mel.shape[-1]) >= cache.capacity:
            cache.reset()
            cache.resets += 1
    trims = [_trim(u) for u in units]
    s = trims[0][1]
    if any(kept != s for _, kept in trims):
        raise ValueError(f"units of different encoder lengths cannot share a batch: {[k for _, k in trims]}")
    t_max = max(u.mel.shape[-1] for u in units)
    # Right zero-padding is what conv1's own padding adds at a slice edge: the kept frames are unchanged.
    mel = torch.stack([F.pad(u.mel.to(dev), (0, t_max - u.mel.shape[-1])) for u in units])  # [B, n_mels, T]
    x = encoder.embed_cnn(mel)  # [B, ceil(T / 2), d]
    lefts = torch.tensor([left for left, _ in trims], device=dev)
    frames = lefts[:, None] + torch.arange(s, device=dev)  # [B, S]
    x = x.gather(1, frames[..., None].expand(-1, -1, x.shape[-1]))  # [B, S, d]
    starts = torch.tensor([c.length for c in caches], device=dev)
    x = x + encoder.embed_positions.weight[starts[:, None] + torch.arange(s, device=dev)]
    past = max(c.length for c in caches)
    keys = torch.arange(past + s, device=dev)
    mask = None
    if any(c.length != past for c in caches):  # [B, 1, 1, P + S]: own past and own unit only
        mask = ((keys[None] < starts[:, None]) | (keys[None] >= past))[:, None, None, :]
    new_k, new_v = [], []
    for i, layer in enumerate(encoder.layers):
        cached = None
        if past:
            cached = (torch.stack([c.k[i, 0, :, :past] for c in caches]),  # [B, H, P, D]
                      torch.stack([c.v[i, 0, :, :past] for c in caches]))
        x, k, v = _layer(layer, x, cached, mask)
        new_k.append(k)
        new_v.append(v)
    k_all, v_all = torch.stack(new_k), torch.stack(new_v)  # [layers, B, H, S, D]
    for b, cache in enumerate(caches):
        start = cache.length
        cache.k[:, 0, :, start:start + s] = k_all[:, b]
        cache.v[:, 0, :, start:start + s] = v_all[:, b]
        cache.length = start + s
    return encoder.layer_norm(x)
