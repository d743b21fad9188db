"""CUDA graphs for the DiT estimator step and the HiFT vocoder at bucketed (exact) shapes.

Replay is copy-in → replay → slice-out. Static outputs are scratch: callers copy them into session
storage before the next replay (`solve_chunk` copies caches at once; HiFT outputs are cloned here).
Static inputs and outputs are shared by the graphs of a kind (static_io.py: the HiFT noise input alone
is 1 MiB per row), so the replay of ANY graph of a kind overwrites that kind's outputs.
On CPU, or when disabled, both runners call the eager modules. Graphs share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cuda_graph import StaticGraph
from engine.token2wav.dit import DiT
from engine.token2wav.encoder import UpsampleConformerEncoder
from engine.token2wav.hift import HiFT
from engine.token2wav.static_io import StaticIO
from engine.warmup import GraphMisses


class GraphCache:
    """Lazily captured graphs keyed by exact input shapes, at most `max_graphs` of each kind."""

    def __init__(self, dit: DiT, hift: HiFT, enabled: bool, max_graphs: int = 32,
                 encoder: UpsampleConformerEncoder | None = None) -> None:
        self.dit, self.hift, self.enc, self.max_graphs = dit, hift, encoder, max_graphs
        self.enabled = enabled and torch.cuda.is_available() and next(dit.parameters()).is_cuda
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.dit_graphs: dict[tuple, StaticGraph] = {}
        self.hift_graphs: dict[tuple, StaticGraph] = {}
        self.enc_graphs: dict[tuple, StaticGraph] = {}
        self.io = StaticIO()                    # static inputs / outputs, shared by the graphs of a kind
        self.misses = GraphMisses("token2wav")  # the engine shares one across its graph caches

    def _get(self, table: dict[tuple, StaticGraph], fn: Callable, inputs: tuple[torch.Tensor, ...],
             extra: tuple = ()) -> StaticGraph | None:
        key = (*extra, *(tuple(t.shape) for t in inputs))
        graph = table.get(key)
        if graph is None:
            # after warm-up a missing shape runs eager, never captured on live traffic (ragged_graphs.py says why)
            eager = len(table) >= self.max_graphs or self.misses.warm
            kind = "dit" if table is self.dit_graphs else "hift" if table is self.hift_graphs else "encoder"
            self.misses.record(kind, key, "eager" if eager else "captured now")
            if not eager:
                graph = table[key] = StaticGraph(self.io.outputs(kind, fn), self.io.inputs(kind, inputs), self.pool)
        return graph

    def estimator(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                  cond: torch.Tensor, cnn: torch.Tensor | None, att: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.enabled or cnn is None or att is None:
            return self.dit.forward_chunk(x, mu, t, spks, cond, cnn, att)
        inputs = (x, mu, t, spks, cond, cnn, att)
        graph = self._get(self.dit_graphs, self.dit.forward_chunk, inputs)
        if graph is None:
            return self.dit.forward_chunk(*inputs)
        v, new_cnn, new_att = graph.run(inputs)
        return v, new_cnn, new_att

    def encoder(self, xs: torch.Tensor, last: bool, cnn: torch.Tensor | None, att: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.enc is not None
        if not self.enabled or cnn is None or att is None:
            return self.enc.forward_chunk(xs, last, cnn, att)
        enc = self.enc
        inputs = (xs, cnn, att)
        graph = self._get(self.enc_graphs, lambda x, c, a: enc.forward_chunk(x, last, c, a), inputs, (last,))
        if graph is None:
            return enc.forward_chunk(xs, last, cnn, att)
        h, new_cnn, new_att = graph.run(inputs)
        # NOTE: static outputs are scratch: clone the caches (they outlive the next replay)
        return h, new_cnn.clone(), new_att.clone()

    def vocoder(self, mel: torch.Tensor, source: torch.Tensor, rand_ini: torch.Tensor, noise: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (mel, source, rand_ini, noise)
        graph = self._get(self.hift_graphs, self.hift.forward, inputs) if self.enabled else None
        if graph is None:
            return self.hift(*inputs)
        speech, src = graph.run(inputs)
        return speech.clone(), src.clone()
