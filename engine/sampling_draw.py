"""The draw primitive of model.md §3.5.4, shared by LLM sampling (Stage0) and TTS sampling (Stage1).

Torch's global RNG cannot be reproduced bit-exactly across batch shapes and devices, so every draw
takes one fp64 uniform u from its session's own CPU generator, in draw order, and the batched kernel
receives each row's u as an input. A row's pick then depends only on its own probabilities and u:
never on the batch, the padding or whether the step runs in a CUDA graph.
"""

from __future__ import annotations

import torch


def session_generator(seed: int) -> torch.Generator:
    """A session's CPU generator for one stream of draws (seeds per stream: §3.5.4)."""
    return torch.Generator(device="cpu").manual_seed(seed)


def draw_uniforms(generator: torch.Generator, count: int) -> torch.Tensor:
    """The next `count` uniforms [count] fp64 in [0, 1) of a session's stream.

    One call for n values consumes the generator exactly like n scalar calls (CPU generator), so
    callers may pre-draw in blocks and rewind with get_state/set_state.
    """
    return torch.rand(count, dtype=torch.float64, generator=generator)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V] (unnormalised allowed), u [B] fp64 in [0, 1) → ids [B] int64.

    The smallest i with cumsum(p)[i] > u · Σp, cumsum and product in fp32 in vocabulary order; if
    rounding leaves no such i, the largest i with p > 0. Pure tensor code, no host sync.
    """
    cdf = torch.cumsum(probs.float(), dim=-1)  # [B, V]
    target = u.to(torch.float32)[:, None] * cdf[:, -1:]  # [B, 1]
    hit = cdf > target  # [B, V]
    vocab = probs.shape[-1]
    positions = torch.arange(vocab, device=probs.device)
    # first True as a min over positions: not a count of cdf <= target, which equals it only while the
    # (device-computed) cumsum is non-decreasing; not an int8 argmax, which gave out-of-range ids under
    # torch.compile in the TTS step graph on the H200.
    first = torch.where(hit, positions, vocab).amin(dim=-1)  # [B], vocab = no hit
    last_positive = torch.where(probs > 0, positions, -1).amax(dim=-1)  # [B] rounding fallback
    # A row with no positive probability (NaN logits: the padding rows of a graph bucket) gets id 0, never
    # −1: the ids feed gathers and scatters (TTS repetition window) that would fault on −1 in the graph.
    return torch.where(first < vocab, first, last_positive.clamp(min=0))
