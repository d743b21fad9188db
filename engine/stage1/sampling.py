"""TTS sampling (model.md §5.4) and the fp64-uniform draw primitive (§3.5.4), batched, no host sync.

Every row carries its own uniform `u` drawn from its session's generator, so a row's sample depends
only on its own logits and u: never on the batch, the padding or whether the step runs in a CUDA graph.
"""

from __future__ import annotations

import torch


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V] fp32 (unnormalised allowed), u [B] fp64 in [0, 1) → ids [B] int64.

    Picks the smallest i with cumsum(p)[i] > u · Σp (cumsum and product in fp32, vocabulary order);
    if rounding leaves no such i, the largest i with p > 0.
    """
    cdf = probs.float().cumsum(-1)  # [B, V]
    target = u.to(torch.float32)[:, None] * cdf[:, -1:]  # [B, 1]
    # cdf is non-decreasing, so the first index above target = the number of entries at or below it
    idx = (cdf <= target).sum(-1)  # [B]
    vocab = probs.shape[-1]
    positions = torch.arange(vocab, device=probs.device)
    last_positive = torch.where(probs > 0, positions, -1).amax(-1)  # [B]
    return torch.where(idx >= vocab, last_positive, idx)


def window_counts(window: torch.Tensor, vocab: int) -> torch.Tensor:
    """window [B, W] int64 codes, `vocab` marking an empty entry → counts [B, vocab] int64."""
    counts = torch.zeros(window.shape[0], vocab + 1, dtype=torch.int64, device=window.device)
    counts.scatter_add_(1, window, torch.ones_like(window))
    return counts[:, :vocab]


def tts_sample(logits: torch.Tensor, window: torch.Tensor, eos_blocked: torch.Tensor, u: torch.Tensor,
               *, temperature: float, penalty: float, eos_id: int) -> torch.Tensor:
    """One TTS sampling step for B rows (§5.4), in fp32.

    logits [B, V]; window [B, W] the current unit's last ≤ W codes (`V` = empty; all empty at t = 0);
    eos_blocked [B] bool (t < min_new_tokens); u [B] fp64. Returns codes [B] int64.
    """
    scores = logits.float() / temperature
    # CustomRepetitionPenaltyLogitsProcessorRepeat: α = penalty^count; negative × α, otherwise ÷ α
    alpha = torch.pow(penalty, window_counts(window, scores.shape[-1]))  # [B, V] fp32
    scores = torch.where(scores < 0, scores * alpha, scores / alpha)
    eos_col = scores[:, eos_id].masked_fill(eos_blocked, float("-inf"))
    scores = torch.cat((scores[:, :eos_id], eos_col[:, None], scores[:, eos_id + 1:]), dim=-1)
    return draw(torch.softmax(scores, dim=-1), u)
