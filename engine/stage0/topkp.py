"""Step B6 of model.md §3.5.2 for the sampling rows: top-k → top-p → one draw, on temperature-scaled logits.

`candidate_draw` selects each row's top `candidates` logits (torch.topk: a selection, no sort of the
151,748-entry vocabulary) and runs top-k, top-p and the draw on those few. It is the reference rule
whenever every logit kept by top-k is among the candidates; a row where that fails (top_k above the
candidate count, or ties at the k-th value that spill past it) is flagged, and the caller draws it again
with `full_draw`, the rule over the whole vocabulary as model.md states it. Both draw in vocabulary
order with the row's own u, so a row's id never depends on its batch.
"""

from __future__ import annotations

import torch

from engine.sampling_draw import draw

NEG_INF = float("-inf")


def full_draw(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """z [B, V] fp32 (temperature applied), top_k [B] int64, top_p [B] fp32, u [B] fp64 → ids [B]."""
    vocab = z.shape[-1]
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)  # ties: ascending id
    kth = sorted_z.gather(1, (top_k.clamp(max=vocab) - 1)[:, None])
    sorted_z = _top_p(torch.where(sorted_z >= kth, sorted_z, NEG_INF), top_p)
    z = torch.full_like(z, NEG_INF).scatter(1, order, sorted_z)
    return draw(torch.softmax(z, -1), u)


def candidate_draw(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
                   candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `full_draw` on each row's top `candidates` logits → (ids [B], exact [B] bool: the row's result is
    the reference's; where False, draw the row again with `full_draw`)."""
    vocab = z.shape[-1]
    k = min(candidates, vocab)
    vals, idx = torch.topk(z, k, dim=-1)  # [B, K]; the order of equal values is unspecified
    idx, by_id = idx.sort(dim=-1)  # candidates in vocabulary order
    vals = vals.gather(1, by_id)
    desc, rank = torch.sort(vals, dim=-1, descending=True, stable=True)  # ties: ascending id, as in `full_draw`
    top_k = top_k.clamp(max=vocab)
    kth = desc.gather(1, (top_k.clamp(max=k) - 1)[:, None])  # [B, 1]
    # every logit >= the k-th must be a candidate, else top-k keeps ids this row never saw
    exact = (top_k <= k) & ((z >= kth).sum(-1) <= k)
    desc = _top_p(torch.where(desc >= kth, desc, NEG_INF), top_p)
    in_id_order = torch.full_like(desc, NEG_INF).scatter(1, rank, desc)  # the draw runs in vocabulary order
    pick = draw(torch.softmax(in_id_order, -1), u)  # [B] index among the candidates
    return idx.gather(1, pick[:, None])[:, 0], exact


def _top_p(desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """desc [B, N] logits sorted descending (−inf = dropped): drop token i when the probability of the tokens
    ranked above it exceeds top_p, so the first token always stays."""
    p = torch.softmax(desc, dim=-1)
    before = torch.cumsum(p, dim=-1) - p
    return torch.where(before > top_p[:, None], NEG_INF, desc)
