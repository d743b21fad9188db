"""Exact-shape flow batches of sessions that own their FlowCache tensors (model.md §6.8); a batch gives each
session what it gets alone (I6).

This path batches sessions only when their shapes match exactly (bucket key below) and stacks /
splits whole caches; the engine's default is the ragged slot-pool path (pool.py, pooled.py). It stays
the solo oracle (one session: no stacking) and serves `ragged=False`. Split results are cloned, so
no session keeps a view into another's batch tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.hostio import to_device
from engine.token2wav.assets import Token2WavModels
from engine.token2wav.call import FlowSession, PendingCall
from engine.token2wav.cfm import EstimatorFn
from engine.token2wav.flow import EncoderFn, FlowCache


def stack_flow_caches(caches: Sequence[FlowCache]) -> FlowCache:
    """B per-session caches (B = 1 each) → one batch cache; CFG rows ordered [cond 1..B; uncond 1..B]."""
    def est(name: str) -> torch.Tensor:
        # per session [n, depth, 2, ...] → [n, depth, 2, B, ...] → [n, depth, 2B, ...]
        s = torch.stack([getattr(c, name) for c in caches], dim=3)
        return s.reshape(*s.shape[:2], -1, *s.shape[4:])

    return FlowCache(torch.cat([c.conformer_cnn for c in caches], dim=0),
                     torch.cat([c.conformer_att for c in caches], dim=1),
                     est("estimator_cnn"), est("estimator_att"))


def split_flow_cache(cache: FlowCache, batch: int) -> list[FlowCache]:
    """Inverse of `stack_flow_caches`, as VIEWS into the batch tensors: pass each through `owned`."""
    def est(t: torch.Tensor, i: int) -> torch.Tensor:
        return t.view(*t.shape[:2], 2, batch, *t.shape[3:])[:, :, :, i]

    return [FlowCache(cache.conformer_cnn[i:i + 1], cache.conformer_att[:, i:i + 1],
                      est(cache.estimator_cnn, i), est(cache.estimator_att, i)) for i in range(batch)]


def owned(cache: FlowCache, batch: FlowCache) -> FlowCache:
    """Clone every tensor of `cache` that still shares storage with the batch (§6.8); a trimmed
    tensor is already a fresh one, so the trim and the split cost one copy, not two."""
    shared = {t.untyped_storage().data_ptr() for t in batch.tensors()}
    return FlowCache(*(t.clone() if t.untyped_storage().data_ptr() in shared else t for t in cache.tensors()))


def flow_bucket_key(cache: FlowCache, n_tokens: int, last: bool, n_timesteps: int) -> tuple:
    """Calls with equal keys can share one flow batch (same noise offset, same attention lengths)."""
    return (n_tokens, last, n_timesteps, cache.conformer_att.shape[3], cache.estimator_att.shape[4])


def hift_bucket_key(mel_frames: int, source_len: int) -> tuple:
    return (mel_frames, source_len)


def group_by(keys: Sequence[tuple]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())


def run_flow_batch(models: Token2WavModels, sessions: Sequence[FlowSession], calls: Sequence[PendingCall],
                   estimator: EstimatorFn | None = None, encoder: EncoderFn | None = None) -> None:
    """Flow phase + trims for sessions whose calls share (m, last) and whose caches share shapes."""
    dev = sessions[0].voice.spk_proj.device
    tokens = to_device(torch.tensor([c.tokens for c in calls], dtype=torch.long), dev)
    spk = torch.cat([s.voice.spk_proj for s in sessions], dim=0)
    cache = sessions[0].flow_cache if len(sessions) == 1 else stack_flow_caches([s.flow_cache for s in sessions])
    mel, new = models.flow.forward_chunk(tokens, spk, cache, calls[0].last, sessions[0].voice.n_timesteps,
                                         estimator, encoder)
    parts = [new] if len(sessions) == 1 else split_flow_cache(new, len(sessions))
    for i, (s, c) in enumerate(zip(sessions, calls, strict=True)):
        trimmed = s.trim_phase(parts[i])
        s.flow_cache = owned(trimmed, new) if len(sessions) > 1 else trimmed
        c.mel = mel[i:i + 1].clone() if len(sessions) > 1 else mel
