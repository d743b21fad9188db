"""Slot-indexed pool of per-session flow caches (model.md §6.8, STYLE.md §4).

Every cache lives in one preallocated tensor per kind, slot-major, so a slot is one contiguous block
that only its session reads or writes:
  est_att [S, n_ts, depth, 2, H, Te, 2hd]   estimator K ‖ V (CFG pair cond, uncond)
  est_cnn [S, n_ts, depth, 2, 2C, k − 1]
  tok_att [S, Lt, H, Tt, 2dk]                conformer token-rate K ‖ V (stored once, not tiled)
  mel_att [S, Lm, H, Tm, 2dk]                conformer mel-rate K ‖ V
  enc_cnn [S, D, 6]
Frames are never moved. A slot keeps, per cache, the *logical* sequence as an index array of
physical positions: the estimator's newest-first storage order of §6.5 step 3, the conformer's
oldest-first history. A call writes its new K/V into free positions of the slot; the §6.5 trims
(Q17/Q18, both conformer variants, the mis-trim of v0.1.2 included) only rewrite the index arrays,
and positions that no index refers to any more are free again. The per-voice base cache is
immutable and copied into the slot at turn start (`SlotState.load`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.token2wav.config import FlowConfig, StreamConfig
from engine.token2wav.voice import VoiceCache


@dataclass(frozen=True)
class PoolConfig:
    """Pool size and the bucket sizes that ragged batches pad to (fewer distinct shapes)."""

    slots: int = 32                 # open sessions at most (full size: ≈ 440 MiB of estimator cache each)
    max_prompt_frames: int = 500    # P cap (10 s voice prompt, §6.1)
    token_bucket: int = 4           # codes per row (+ look-ahead pad) round up to this
    cache_bucket: int = 32          # gathered history / estimator window round up to this


class PoolError(RuntimeError):
    """No free slot, a voice prompt above the pool's cap, or a slot overflow."""


def _free_positions(used: np.ndarray, n: int, cap: int) -> np.ndarray:
    """The `n` lowest physical positions in [0, cap) that `used` does not name."""
    free = np.ones(cap, dtype=bool)
    free[used] = False
    out = np.flatnonzero(free)[:n]
    if out.shape[0] < n:
        raise PoolError(f"cache slot overflow: {n} new frames, {out.shape[0]} free of {cap}")
    return out


class FlowPool:
    def __init__(self, fcfg: FlowConfig, scfg: StreamConfig, pcfg: PoolConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.fcfg, self.scfg, self.pcfg, self.device = fcfg, scfg, pcfg, device
        n_ts, s = scfg.n_timesteps, pcfg.slots
        new_max = fcfg.up_stride * scfg.chunk_call               # most mel frames one call adds
        self.mel_cap = pcfg.max_prompt_frames + scfg.cache_keep_frames + new_max
        self.tok_cap = self.mel_cap // fcfg.up_stride + 1
        up = lambda n: pcfg.cache_bucket * -(-n // pcfg.cache_bucket)  # noqa: E731
        # +1: a trash column past every used position takes the K/V of padded query frames
        self.est_width = up(self.mel_cap + 1)
        # the conformer histories gathered at the caps: a graph batch's fixed widths (pooled.py), what the solver
        # reserves for their static inputs
        self.tok_width, self.mel_width = up(self.tok_cap), up(self.mel_cap)
        hd2, dk2 = 2 * fcfg.dit_head_dim, 2 * (fcfg.enc_dim // fcfg.enc_heads)
        z = lambda *shape: torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
        self.est_att = z(s, n_ts, fcfg.dit_depth, 2, fcfg.dit_heads, self.est_width, hd2)
        self.est_cnn = z(s, n_ts, fcfg.dit_depth, 2, 2 * fcfg.dit_hidden, fcfg.dit_conv_kernel - 1)
        self.tok_att = z(s, fcfg.enc_blocks, fcfg.enc_heads, self.tok_cap, dk2)
        self.mel_att = z(s, fcfg.enc_up_blocks, fcfg.enc_heads, self.mel_cap, dk2)
        self.enc_cnn = z(s, fcfg.enc_dim, fcfg.enc_cnn_cache_len)
        self._free = list(range(s - 1, -1, -1))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.est_att, self.est_cnn, self.tok_att, self.mel_att, self.enc_cnn)

    def check_voice(self, voice: VoiceCache) -> None:
        if voice.prompt_frames > self.pcfg.max_prompt_frames:
            raise PoolError(f"voice prompt of {voice.prompt_frames} frames exceeds the pool cap "
                            f"{self.pcfg.max_prompt_frames}")

    def acquire(self) -> SlotState:
        if not self._free:
            raise PoolError(f"all {self.pcfg.slots} Token2Wav cache slots are in use")
        return SlotState(self, self._free.pop())

    def release(self, state: SlotState) -> None:
        if state.slot < 0 or state.slot in self._free or state.pool is not self:
            raise PoolError(f"slot {state.slot} released twice")
        self._free.append(state.slot)
        state.slot = -1


class SlotState:
    """One session's slot plus the logical index arrays (physical positions) of its caches."""

    def __init__(self, pool: FlowPool, slot: int) -> None:
        self.pool, self.slot = pool, slot
        self.prompt_frames = 0
        empty = np.zeros(0, dtype=np.int64)
        self.est, self.tok, self.mel = empty, empty, empty

    def views(self) -> list[torch.Tensor]:
        """This slot's block of every pool tensor (contiguous, disjoint from every other slot)."""
        return [t[self.slot] for t in self.pool.tensors()]

    def load(self, voice: VoiceCache) -> None:
        """Turn start: copy the voice's immutable base cache (B = 1, packed layout) into the slot."""
        p, base, n_tok = self.pool, voice.flow, self.pool.fcfg.enc_blocks
        p.check_voice(voice)
        t_est, t_enc = base.estimator_att.shape[4], base.conformer_att.shape[3]
        p.est_att[self.slot, :, :, :, :, :t_est].copy_(base.estimator_att)
        p.est_cnn[self.slot].copy_(base.estimator_cnn)
        p.tok_att[self.slot, :, :, : t_enc // 2].copy_(base.conformer_att[:n_tok, 0, :, : t_enc // 2])
        p.mel_att[self.slot, :, :, :t_enc].copy_(base.conformer_att[n_tok:, 0])
        p.enc_cnn[self.slot].copy_(base.conformer_cnn[0])
        self.prompt_frames = voice.prompt_frames
        self.est = np.arange(t_est)
        self.tok, self.mel = np.arange(t_enc // 2), np.arange(t_enc)

    def free_est(self, n: int) -> np.ndarray:
        return _free_positions(self.est, n, self.pool.mel_cap)

    def free_tok(self, n: int) -> np.ndarray:
        return _free_positions(self.tok, n, self.pool.tok_cap)

    def free_mel(self, n: int) -> np.ndarray:
        return _free_positions(self.mel, n, self.pool.mel_cap)

    def append(self, est: np.ndarray, tok: np.ndarray, mel: np.ndarray) -> None:
        """Record one call's new frames (estimator newest first), then apply the §6.5 trims."""
        s, p, keep = self.pool.scfg, self.prompt_frames, self.pool.scfg.cache_keep_frames
        self.est = np.concatenate([est, self.est])
        self.tok, self.mel = np.concatenate([self.tok, tok]), np.concatenate([self.mel, mel])
        if self.est.shape[0] > p + keep:
            head, tail = (p, keep) if s.flow_cache_trim == "reference" else (keep, p)
            self.est = np.concatenate([self.est[:head], self.est[-tail:]])
        if self.mel.shape[0] > p + keep:
            if s.conformer_cache_trim == "v0.1.2":
                # the packed tensor is [tok, tok] (tiled); the trim cuts it like the mel half and the
                # next call reads its first half (the reference mis-trim, §6.5 step 4)
                packed = np.concatenate([self.tok, self.tok])
                packed = np.concatenate([packed[:p], packed[-keep:]])
                self.tok = packed[: packed.shape[0] // 2]
            else:
                stride = self.pool.fcfg.up_stride
                self.tok = np.concatenate([self.tok[: p // stride], self.tok[-(keep // stride):]])
            self.mel = np.concatenate([self.mel[:p], self.mel[-keep:]])
