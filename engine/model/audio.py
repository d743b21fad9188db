"""Whisper-medium encoder with a per-session streaming KV cache, projector and pool (model.md §1.3, §2.4-§2.6).

State-dict keys equal the checkpoint's `apm.*` / `audio_projection_layer.*` keys without the prefix.
Two entry points share the weights: `forward` (offline, optional block-causal and padding masks, the
reference-audio path) and `forward_stream` (one unit's mel slice against an `AudioKVCache`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import AudioConfig

CONV_STRIDE = 2  # conv2 stride: mel frames -> encoder frames
ENCODER_FRAMES_PER_SECOND = 50  # block-mask unit for `audio_chunk_length` (seconds)


def cnn_length(mel_frames: int) -> int:
    """Encoder frames after conv2: ceil(T / 2)."""
    return (mel_frames - 1) // CONV_STRIDE + 1


def pooled_length(mel_frames: int, pool_step: int) -> int:
    """LLM embeddings for T mel frames (§2.5): ((T - 1)//2 + 1 - pool)//pool + 1."""
    return (cnn_length(mel_frames) - pool_step) // pool_step + 1


def block_causal_mask(size: int, block: int, lengths: torch.Tensor | None = None,
                      device: torch.device | None = None) -> torch.Tensor:
    """Boolean attend-mask [B or 1, 1, size, size]: frame i sees [0, block·(i//block + 1)) ∩ [0, len)."""
    idx = torch.arange(size, device=device)
    allowed = idx[None, :] < ((idx[:, None] // block) + 1) * block  # [S, S]
    if lengths is None:
        return allowed[None, None]
    valid = idx[None, :] < lengths.to(device)[:, None]  # [B, S]
    return allowed[None, None] & valid[:, None, None, :]


@dataclass(eq=False)
class AudioKVCache:
    """One session's encoder KV: [layers, 1, heads, max_source_positions, head_dim], its own tensors or views
    of its slot of an `AudioKVPool` (then `pool` and `slot` say which; NOTE: the batched encoder then reads and
    writes the pool, not `k` / `v`: never rebind them on a pooled cache)."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0  # S_prev: frames cached
    resets: int = 0  # how many times the §2.4 reset rule fired (observability, tests)
    pool: AudioKVPool | None = field(default=None, repr=False)
    slot: int | None = None

    def reset(self) -> None:
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]


class AudioKVPool:
    """Every session's encoder KV in one K and one V tensor [layers, slots, heads, max_source_positions, head_dim]
    (STYLE.md practice 4), so the batched encoder reads a layer's window for all its sessions with one gather and
    writes their new K/V with one scatter (engine/audio/batched.py), whatever the batch size.

    `take` hands out a slot as an `AudioKVCache` viewing it (the per-session `forward_stream` sees an ordinary
    cache), or None when every slot is taken. The slot is free again once that cache object is garbage: the
    front end has no close call of its own, and a state an audio worker still holds must keep its slot.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # [layers, slots + 1, heads, max_source_positions, head_dim]
        # the last slot is never handed out: a captured encoder step's padding rows write there (engine/audio/graphs.py)
        self.scratch = k.shape[1] - 1
        # NOTE: list append / pop are atomic under the GIL: a finalizer may run on any thread (the one that drops
        # the last reference, or a collection inside `take` itself), so no lock that it could deadlock on.
        self._free = list(range(self.scratch - 1, -1, -1))

    @classmethod
    def allocate(cls, cfg: AudioConfig, slots: int, device: torch.device | str,
                 dtype: torch.dtype) -> AudioKVPool:
        shape = (cfg.encoder_layers, slots + 1, cfg.encoder_attention_heads, cfg.max_source_positions, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def slots(self) -> int:
        """Slots handed out to sessions (the scratch slot not counted)."""
        return self.scratch

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> AudioKVCache | None:
        try:
            slot = self._free.pop()
        except IndexError:
            return None
        cache = AudioKVCache(k=self.k[:, slot: slot + 1], v=self.v[:, slot: slot + 1], pool=self, slot=slot)
        weakref.finalize(cache, self._free.append, slot)
        return cache

    def holds(self, caches: Sequence[AudioKVCache]) -> bool:
        """Are all `caches` slots of this pool (so the batched encoder may index the pool for them)?"""
        return all(c.pool is self for c in caches)


class WhisperAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)  # Whisper: no k bias
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: AudioKVCache | None = None, layer: int = 0) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        if cache is not None:
            start, stop = cache.length, cache.length + s
            cache.k[layer, :, :, start:stop] = k
            cache.v[layer, :, :, start:stop] = v
            k, v = cache.k[layer, :, :, :stop], cache.v[layer, :, :, :stop]  # [1, H, S_prev + S, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, D]
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = WhisperAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: AudioKVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask, cache, layer)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))  # exact (erf) GELU


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=CONV_STRIDE, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def embed_cnn(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, T] -> [B, ceil(T/2), d]; the convs zero-pad at the slice edges."""
        x = mel.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))  # [B, d, S]
        return x.transpose(1, 2)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor | None = None,
                block: int | None = None) -> torch.Tensor:
        """Offline: [B, n_mels, T] -> post-LN hidden [B, S, d].

        `lengths` are valid encoder frames per item (padding mask on keys); `block` enables the
        block-causal mask in encoder frames (50 for `audio_chunk_length` = 1.0).
        """
        x = self.embed_cnn(mel)  # [B, S, d]
        s = x.shape[1]
        if s > self.cfg.max_source_positions:
            raise ValueError(f"{s} encoder frames exceed max_source_positions {self.cfg.max_source_positions}")
        x = x + self.embed_positions.weight[:s]
        mask = None
        if block is not None:
            mask = block_causal_mask(s, block, lengths, x.device)
        elif lengths is not None:
            mask = (torch.arange(s, device=x.device)[None, :] < lengths.to(x.device)[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return self.layer_norm(x)

    def allocate_cache(self, device: torch.device | None = None,
                       dtype: torch.dtype | None = None) -> AudioKVCache:
        cfg = self.cfg
        ref = self.conv1.weight
        shape = (cfg.encoder_layers, 1, cfg.encoder_attention_heads, cfg.max_source_positions, cfg.head_dim)
        kw = dict(device=device or ref.device, dtype=dtype or ref.dtype)
        return AudioKVCache(k=torch.zeros(shape, **kw), v=torch.zeros(shape, **kw))

    def forward_stream(self, mel: torch.Tensor, cache: AudioKVCache,
                       prefix_extra: int, suffix_extra: int) -> torch.Tensor:
        """One unit (§2.4): [1, n_mels, T] with redundancy frames -> post-LN hidden [1, S', d].

        Resets the cache first when S_prev + ceil(T/2) >= max_source_positions, trims ceil(extra/2)
        CNN frames per side, adds positions from S_prev, attends to cache + new frames, appends.
        """
        if cache.length + cnn_length(mel.shape[-1]) >= cache.capacity:
            cache.reset()
            cache.resets += 1
        x = self.embed_cnn(mel)  # [1, ceil(T/2), d]
        left = (prefix_extra + 1) // 2 if prefix_extra > 0 else 0
        right = (suffix_extra + 1) // 2 if suffix_extra > 0 else 0
        x = x[:, left:]
        if 0 < right < x.shape[1]:
            x = x[:, :-right]
        s, start = x.shape[1], cache.length
        x = x + self.embed_positions.weight[start: start + s]
        for i, layer in enumerate(self.layers):
            x = layer(x, None, cache, i)  # no mask: bidirectional within the unit, all of the past
        cache.length = start + s
        return self.layer_norm(x)


class AudioProjector(nn.Module):
    """Linear -> ReLU -> Linear, then AvgPool1d(pool, pool) over time (no weights)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))

    def embed(self, hidden: torch.Tensor, pool_step: int) -> torch.Tensor:
        """Encoder output [B, S, d] -> pooled LLM embeddings [B, S // pool_step, out_dim]."""
        x = self(hidden.to(self.linear1.weight.dtype)).transpose(1, 2)  # [B, out, S]
        return F.avg_pool1d(x, pool_step, pool_step).transpose(1, 2)
