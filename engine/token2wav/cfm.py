"""Causal conditional flow matching, streaming Euler solve (model.md §1.6, §6.5 step 2, §6.7).

Classifier-free guidance doubles the batch as [conditional rows; unconditional rows]; the
unconditional rows see μ, spk and cond all zero. Each Euler step has its own estimator cache.
Per-step caches are stacked on a leading dim:
  cnn [n_ts, depth, 2B, 2C, k − 1]   att [n_ts, depth, 2B, H, T, 2·hd]  (rows: cond 0..B−1, uncond)
The new caches are written into freshly allocated tensors that the caller owns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch


class EstimatorFn(Protocol):
    def __call__(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, cnn_cache: torch.Tensor | None, att_cache: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def cosine_t_span(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t_i = 1 − cos(π/2 · i/n), i = 0..n (computed like the reference, in the model dtype)."""
    t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t * 0.5 * math.pi)


def euler_steps(t_span: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(t, dt) per step with the reference's float arithmetic (t accumulates, dt = t_{i+1} − t)."""
    t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
    out = []
    for step in range(1, len(t_span)):
        out.append((t, dt))
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return out


def solve_chunk(estimator: EstimatorFn | Callable, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, n_timesteps: int, cfg_rate: float,
                cnn_cache: torch.Tensor | None, att_cache: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """noise, mu, cond [B, 80, F]; spks [B, 80] → (mel [B, 80, F], cnn cache, att cache)."""
    b = mu.shape[0]
    mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)                      # [2B, 80, F]
    spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
    cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
    x = noise
    new_cnn: torch.Tensor | None = None
    new_att: torch.Tensor | None = None
    for step, (t, dt) in enumerate(euler_steps(cosine_t_span(n_timesteps, mu.device, mu.dtype))):
        v, cnn, att = estimator(torch.cat([x, x], dim=0), mu_in, t.expand(2 * b), spks_in, cond_in,
                                cnn_cache[step] if cnn_cache is not None else None,
                                att_cache[step] if att_cache is not None else None)
        if new_cnn is None or new_att is None:
            new_cnn = cnn.new_empty((n_timesteps, *cnn.shape))
            new_att = att.new_empty((n_timesteps, *att.shape))
        new_cnn[step].copy_(cnn)
        new_att[step].copy_(att)
        v_cond, v_uncond = v[:b], v[b:]
        x = x + dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
    assert new_cnn is not None and new_att is not None
    return x, new_cnn, new_att


def solve_ragged(estimator: Callable[..., tuple[torch.Tensor, torch.Tensor]], noise: torch.Tensor,
                 mu: torch.Tensor, spks: torch.Tensor, n_timesteps: int, cfg_rate: float, cnn_cache: torch.Tensor,
                 kv: Callable[[int], torch.Tensor], key_mask: torch.Tensor, wpos: torch.Tensor, cnn_end: torch.Tensor,
                 store: Callable[[int, torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged streaming solve (`DiT.forward_ragged`): rows are right-padded to F frames.

    noise, mu [B, 80, F]; spks [B, 80]; cnn_cache [n_ts, depth, 2B, 2C, k − 1]; `kv(step)` gives the
    step's K/V window [depth, 2B, H, Tg, 2hd], which the step writes its new K/V into (at `wpos` [2B, F])
    and `store(step, window)` then keeps; key_mask [2B, Tg]; cnn_end [2B, k − 1]
    → (mel [B, 80, F], new cnn caches [n_ts, depth, 2B, 2C, k − 1]).
    """
    b = mu.shape[0]
    mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)                      # [2B, 80, F]
    spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
    cond_in = torch.zeros_like(mu_in)                                         # streaming chunks: cond = 0
    x = noise
    new_cnn = torch.empty_like(cnn_cache)
    for step, (t, dt) in enumerate(euler_steps(cosine_t_span(n_timesteps, mu.device, mu.dtype))):
        window = kv(step)
        v, cnn = estimator(torch.cat([x, x], dim=0), mu_in, t.expand(2 * b), spks_in, cond_in,
                           cnn_cache[step], window, key_mask, wpos, cnn_end)
        store(step, window)
        del window                           # one step's window alive at a time (its memory serves the next)
        new_cnn[step].copy_(cnn)
        x = x + dt * ((1.0 + cfg_rate) * v[:b] - cfg_rate * v[b:])
    return x, new_cnn
