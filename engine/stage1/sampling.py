"""TTS sampling (model.md §5.4) on the shared fp64-uniform draw primitive (§3.5.4), batched, no host sync.

Every row carries its own uniform `u` drawn from its session's generator, so a row's sample depends
only on its own logits and u: never on the batch, the padding or whether the step runs in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.sampling_draw import draw

__all__ = ["draw", "tts_sample", "window_counts"]


def window_counts(window: torch.Tensor, vocab: int) -> torch.Tensor:
    """window [B, W] int64 codes, `vocab` marking an empty entry → counts [B, vocab] int64."""
    counts = torch.zeros(window.shape[0], vocab + 1, dtype=torch.int64, device=window.device)
    counts.scatter_add_(1, window, torch.ones_like(window))
    return counts[:, :vocab]


def tts_sample(logits: torch.Tensor, window: torch.Tensor, eos_blocked: torch.Tensor, u: torch.Tensor,
               *, temperature: float | torch.Tensor, penalty: float | torch.Tensor, eos_id: int) -> torch.Tensor:
    """One TTS sampling step for B rows (§5.4), in fp32.

    logits [B, V]; window [B, W] the current unit's last ≤ W codes (`V` = empty; all empty at t = 0);
    eos_blocked [B] bool (t < min_new_tokens); u [B] fp64. Returns codes [B] int64.
    """
    if isinstance(temperature, torch.Tensor):  # per row [B] (each session's talker settings)
        temperature, penalty = temperature[:, None], penalty[:, None]  # type: ignore[index]
    scores = logits.float() / temperature
    # CustomRepetitionPenaltyLogitsProcessorRepeat: α = penalty^count; negative × α, otherwise ÷ α
    alpha = torch.pow(penalty, window_counts(window, scores.shape[-1]))  # [B, V] fp32
    scores = torch.where(scores < 0, scores * alpha, scores / alpha)
    eos_col = scores[:, eos_id].masked_fill(eos_blocked, float("-inf"))
    scores = torch.cat((scores[:, :eos_id], eos_col[:, None], scores[:, eos_id + 1:]), dim=-1)
    return draw(torch.softmax(scores, dim=-1), u)
