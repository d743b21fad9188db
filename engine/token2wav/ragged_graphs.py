"""CUDA graphs for the ragged flow: the estimator solve (`solve_ragged`, all Euler steps in one graph)
and the conformer encoder (`encode_ragged`; eager, its few hundred small kernels made batch 1
launch-bound: 35 ms per chunk against 19 ms of GPU work on the H200).

A graph is keyed by the batch's bucketed shapes (rows, frames, estimator window Tg, steps). The
estimator K/V window is by far the largest input ([n_ts, depth, 2B, H, Tg, 2hd], ≈ 440 MiB per row at
full size), so it is not copied in: every graph reads and writes it in ONE shared static buffer that
the caller gathers the slots into (`kv_buffer`); the same shape always maps to the same prefix view,
hence the same pointers. The small inputs are copied in; outputs (mel, cnn caches) are scratch that
the caller copies into session storage before the next replay (§6.8). Growing the shared buffer drops
every graph (they hold the old pointer). Warm-up runs rewrite the same new K/V (idempotent).
On CPU, or when disabled, `solve` runs eagerly and `kv_buffer` is a fresh tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.token2wav.cfm import solve_ragged
from engine.token2wav.dit import DiT
from engine.token2wav.flow import Flow
from engine.token2wav.ragged import encode_ragged
from engine.warmup import GraphMisses

KV_INPUT = 4     # position of the K/V window in the solver's input tuple


class _Graph:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...],
                 pool: object, shared: int | None) -> None:
        self.shared = shared                        # index of the input read in place (never copied), or None
        self.inputs = tuple(t if i == shared else t.clone() for i, t in enumerate(inputs))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):                      # warm-up: cuBLAS plans and allocator state before capture
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for i, (dst, src) in enumerate(zip(self.inputs, inputs, strict=True)):
            if i == self.shared:
                if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
                    raise RuntimeError("ragged graph: the K/V window must come from kv_buffer")
                continue
            dst.copy_(src)
        self.graph.replay()
        return self.outputs


class RaggedSolver:
    """`solve_ragged` with the DiT and `encode_ragged`, eager or from graphs (at most `max_graphs`
    of each, then eager)."""

    def __init__(self, dit: DiT, enabled: bool, max_graphs: int = 32) -> None:
        self.dit, self.max_graphs = dit, max_graphs
        self.enabled = enabled and torch.cuda.is_available() and next(dit.parameters()).is_cuda
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.graphs: dict[tuple, _Graph] = {}
        self.enc_graphs: dict[tuple, _Graph] = {}
        self._kv: torch.Tensor | None = None
        self.misses = GraphMisses("token2wav")  # the engine shares one across its graph caches

    def kv_buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Where the caller gathers the batch's estimator K/V window [n_ts, depth, 2, B, H, Tg, 2hd]."""
        if not self.enabled:
            return like.new_empty(shape)
        n = math.prod(shape)
        if self._kv is None or self._kv.numel() < n or self._kv.dtype != like.dtype:
            self._kv = like.new_empty(n)
            self.graphs.clear()
        return self._kv[:n].view(shape)

    def solve(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, n_timesteps: int, cfg_rate: float,
              cnn: torch.Tensor, kv: torch.Tensor, key_mask: torch.Tensor, wpos: torch.Tensor, cnn_end: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        def fn(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor, c: torch.Tensor, k: torch.Tensor,
               mask: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return solve_ragged(self.dit.forward_ragged, x, m, s, n_timesteps, cfg_rate, c, k, mask, w, e)

        inputs = (noise, mu, spks, cnn, kv, key_mask, wpos, cnn_end)
        if not self.enabled:
            return fn(*inputs)
        key = (n_timesteps, cfg_rate, *(tuple(t.shape) for t in inputs))
        return self._replay(self.graphs, key, fn, inputs, KV_INPUT)  # type: ignore[return-value]

    def encode(self, flow: Flow, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`encode_ragged(flow, *inputs)`; inputs are bucketed by the caller, so shapes repeat.
        Outputs of a replay are scratch: the caller copies them out before the next call."""
        def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return encode_ragged(flow, *xs)

        if not self.enabled:
            return fn(*inputs)
        key = tuple(tuple(t.shape) for t in inputs)
        return self._replay(self.enc_graphs, key, fn, inputs, None)

    def _replay(self, graphs: dict[tuple, _Graph], key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]],
                inputs: tuple[torch.Tensor, ...], shared: int | None) -> tuple[torch.Tensor, ...]:
        graph = graphs.get(key)
        if graph is None:
            full = len(graphs) >= self.max_graphs
            self.misses.record("solve" if shared is not None else "encode", key, "eager" if full else "captured now")
            if full:
                return fn(*inputs)
            graph = graphs[key] = _Graph(fn, inputs, self.pool, shared)
        return graph.run(inputs)
