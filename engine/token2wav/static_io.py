"""Static inputs and outputs of CUDA graphs, shared by every graph of a kind (graphs.py, ragged_graphs.py).

A captured graph reads its inputs from, and writes its outputs to, fixed addresses. Keeping a copy of
each per graph made those bytes grow with the number of graphs × their rows (at 32 sessions: 11 graphs
per batch size, ≈ 14 MiB per row and graph pair of the ragged flow, 1.3 MiB per row of HiFT). The graphs
of one runner replay one at a time: each copies its inputs in right before its replay, and callers copy
the outputs out before the next replay. So one flat buffer per (kind, position) serves all of them,
viewed at each graph's shape with the strides `clone()` would give (the captured kernels see the layout
the eager run saw). A buffer that must grow is replaced; graphs captured earlier keep the old one, so
`reserve` the largest size first where it is known.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Fn = Callable[..., tuple[torch.Tensor, ...]]


class StaticIO:
    def __init__(self) -> None:
        self._flat: dict[tuple[str, int], torch.Tensor] = {}

    def reserve(self, kind: str, position: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The flat buffer of (kind, position), at least `numel` elements of `like`'s dtype and device."""
        flat = self._flat.get((kind, position))
        if flat is None or flat.numel() < numel or flat.dtype != like.dtype or flat.device != like.device:
            flat = self._flat[(kind, position)] = like.new_empty(numel)
        return flat

    def copy(self, kind: str, position: int, t: torch.Tensor) -> torch.Tensor:
        """A static copy of `t` in the buffer of (kind, position)."""
        stride = torch.empty_like(t, device="meta").stride()
        return self.reserve(kind, position, t.numel(), t).as_strided(t.shape, stride).copy_(t)

    def inputs(self, kind: str, inputs: tuple[torch.Tensor, ...], shared: int | None = None
               ) -> tuple[torch.Tensor, ...]:
        """Static copies of a graph's inputs; the one at `shared` is read in place and kept as it is."""
        return tuple(t if i == shared else self.copy(kind, i, t) for i, t in enumerate(inputs))

    def outputs(self, kind: str, fn: Fn) -> Fn:
        """`fn` that copies its results into the buffers of (kind + " out", position) and returns those
        views: the graph's own results become intermediates the next capture can reuse, instead of outputs
        pinned in the graph pool per graph. The buffers are taken at the first call, an eager run before
        the capture."""
        outs: list[torch.Tensor] = []

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            res = fn(*xs)
            if not outs:
                outs.extend(self.copy(f"{kind} out", i, r) for i, r in enumerate(res))
            else:
                for o, r in zip(outs, res, strict=True):
                    o.copy_(r)
            return tuple(outs)
        return run

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())
