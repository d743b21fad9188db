"""CUDA graphs for the ragged flow: the estimator solve (`solve_ragged`, all Euler steps in one graph)
and the conformer encoder (`encode_ragged`; eager, its few hundred small kernels made batch 1
launch-bound: 35 ms per chunk against 19 ms of GPU work on the H200).

A graph is keyed by the batch's bucketed shapes (rows, frames, estimator window Tg, steps); the rows
are bucketed too (`rows`, buckets.py), so graphs exist per row bucket, not per batch size. The
estimator K/V window is by far the largest input ([n_ts, depth, 2B, H, Tg, 2hd]: n_ts · 128 KiB per
frame and row in float32, 210 MiB per row at float16 and the full 672-frame window), so it is not
copied in: every graph reads and writes it in ONE shared static buffer that the caller gathers the
slots into (`kv_buffer`); the same shape always maps to the same prefix view, hence the same pointers.
Growing the shared buffer drops every graph (they hold the old pointer). Warm-up runs rewrite the same
new K/V (idempotent). The buffer starts zeroed, so a dummy row's masked keys are finite stale values.
The other inputs are copied in at replay; their static copies are not per graph either but shared by
the graphs of a kind (static_io.py). That matters for the conformer history (≈ 10 MiB per row at full
window, float16) and the estimator conv caches (0.6 MiB per row), which per graph came to GBs. Outputs
(μ, new K/V, mel, cnn caches) are scratch that the caller copies into session storage before the next
replay (§6.8); they too are shared per kind, so the replay of ANY graph of that kind overwrites them.
On CPU, or when disabled, `solve` runs eagerly, `rows(n)` is n and `kv_buffer` is a fresh tensor.

Memory of a solver with graphs, per max_batch rows B (float16, full size, P ≤ 500):
  K/V window buffer   B · n_ts · depth · 2 · H · W · 2hd · 2 B   = B · 210 MiB at W = 672
  static inputs       B · (history ≈ 10 MiB + conv caches 0.6 MiB + small), once for all graphs
  graph outputs       B · (≈ 0.7 MiB encoder + 0.6 MiB solve), once for all graphs; they were pinned per
                      graph: ~5 + 5 graphs per batch size over Σ 1..32 = 528 rows → ≈ 3.5 GiB at B = 32
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.token2wav.buckets import bucket_rows
from engine.token2wav.cfm import solve_ragged
from engine.token2wav.dit import DiT
from engine.token2wav.flow import Flow
from engine.token2wav.ragged import encode_ragged
from engine.token2wav.static_io import StaticIO
from engine.warmup import GraphMisses

KV_INPUT = 4     # position of the K/V window in the solver's input tuple
TOK_INPUT, MEL_INPUT = 4, 6   # positions of the conformer histories in the encoder's input tuple


class _Graph:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...],
                 pool: object, shared: int | None) -> None:
        self.shared = shared                        # index of the input read in place (never copied), or None
        self.inputs = inputs                        # static inputs (StaticIO), filled
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
    of each, then eager). With graphs a batch of n rows runs at `rows(n)`, the smallest of `buckets`."""

    def __init__(self, dit: DiT, enabled: bool, max_graphs: int = 32, buckets: tuple[int, ...] = ()) -> None:
        self.dit, self.max_graphs, self.buckets = dit, max_graphs, buckets
        self.enabled = enabled and torch.cuda.is_available() and next(dit.parameters()).is_cuda
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.graphs: dict[tuple, _Graph] = {}
        self.enc_graphs: dict[tuple, _Graph] = {}
        self._kv: torch.Tensor | None = None
        self.io = StaticIO()                    # static inputs / outputs, shared by the graphs of a kind
        self.misses = GraphMisses("token2wav")  # the engine shares one across its graph caches

    def rows(self, n: int) -> int:
        """Batch rows for n real rows: the row bucket with graphs (dummy rows pad it), n eagerly."""
        return bucket_rows(n, self.buckets) if self.enabled and self.buckets else n

    def kv_buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Where the caller gathers the batch's estimator K/V window [n_ts, depth, 2, B, H, Tg, 2hd]."""
        if not self.enabled:
            return like.new_zeros(shape)
        n = math.prod(shape)
        if self._kv is None or self._kv.numel() < n or self._kv.dtype != like.dtype:
            self._kv = like.new_zeros(n)        # zeroed: a dummy row's masked keys are never NaN garbage
            self.graphs.clear()
        return self._kv[:n].view(shape)

    def reserve(self, kind: str, position: int, numel: int, like: torch.Tensor) -> None:
        """Size the static storage of input `position` of `kind` ("solve" / "encode") for its largest
        shape up front (warm-up): graphs captured before a later growth would keep the smaller one."""
        if self.enabled:
            self.io.reserve(kind, position, numel, like)

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
        return self._replay(self.graphs, "solve", key, fn, inputs, KV_INPUT)  # type: ignore[return-value]

    def encode(self, flow: Flow, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`encode_ragged(flow, *inputs)`; inputs are bucketed by the caller, so shapes repeat.
        Outputs of a replay are scratch: the caller copies them out before the next call."""
        def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return encode_ragged(flow, *xs)

        if not self.enabled:
            return fn(*inputs)
        key = tuple(tuple(t.shape) for t in inputs)
        return self._replay(self.enc_graphs, "encode", key, fn, inputs, None)

    def _replay(self, graphs: dict[tuple, _Graph], kind: str, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]],
                inputs: tuple[torch.Tensor, ...], shared: int | None) -> tuple[torch.Tensor, ...]:
        graph = graphs.get(key)
        if graph is None:
            full = len(graphs) >= self.max_graphs
            self.misses.record(kind, key, "eager" if full else "captured now")
            if full:
                return fn(*inputs)
            graph = graphs[key] = _Graph(self.io.outputs(kind, fn), self.io.inputs(kind, inputs, shared), self.pool,
                                         shared)
        return graph.run(inputs)
