"""CUDA graphs for the single-token decode step (STYLE.md practice 5).

Decode uses the dense layout: row i of the batch is KV slot i, so attention reads the cache as a view
with no gather. A graph is captured per (batch bucket ≥ highest live slot + 1, attention-span bucket),
all in one memory pool. Replay is copy-in → replay → slice-out; idle rows write to the reserved position.
`DenseDecode.run` is also the eager path (CPU tests exercise the same layout); `create()` returns None
off CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.llm import Qwen3LLM, SlotKVCache


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [b, 1, H]
    pos: torch.Tensor  # [b, 1]
    out: torch.Tensor  # [b, 1, H]


def _bucket(value: int, buckets: tuple[int, ...]) -> int:
    return min(b for b in buckets if b >= value)


def dense_inputs(kv: SlotKVCache, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter live rows to their slots: x [N, H] → [rows, 1, H]; pos [N] → [rows, 1] (idle: reserved)."""
    dense_x = torch.zeros(rows, 1, x.shape[-1], dtype=x.dtype, device=x.device)
    dense_pos = torch.full((rows, 1), kv.reserved_pos, dtype=torch.long, device=x.device)
    dense_x[slots, 0] = x
    dense_pos[slots, 0] = pos
    return dense_x, dense_pos


class DecodeGraphs:
    def __init__(self, model: Qwen3LLM, kv: SlotKVCache, batch_buckets: tuple[int, ...],
                 kv_buckets: tuple[int, ...], compile_mode: str | None = None) -> None:
        self.model, self.kv = model, kv
        # torch.compile fuses the many small decode kernels; the graph then removes launch overhead
        self.fn = model if compile_mode is None else torch.compile(model, mode=compile_mode, dynamic=False)
        self.batch_buckets = tuple(sorted({min(b, kv.slots) for b in batch_buckets} | {kv.slots}))
        self.kv_buckets = tuple(sorted({b for b in kv_buckets if b < kv.max_len} | {kv.max_len}))
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    @classmethod
    def create(cls, model: Qwen3LLM, kv: SlotKVCache, batch_buckets: tuple[int, ...],
               kv_buckets: tuple[int, ...] = (), enabled: bool = True,
               compile_mode: str | None = None) -> DecodeGraphs | None:
        if not enabled or kv.k[0].device.type != "cuda":
            return None
        graphs = cls(model, kv, batch_buckets, kv_buckets, compile_mode)
        graphs.capture()
        return graphs

    @torch.no_grad()
    def capture(self) -> None:
        dev, h = self.kv.k[0].device, self.model.cfg.hidden_size
        dtype = next(self.model.parameters()).dtype
        # largest first so the shared pool is sized by the biggest graph
        for b in sorted(self.batch_buckets, reverse=True):
            for span in sorted(self.kv_buckets, reverse=True):
                g = _Graph(torch.cuda.CUDAGraph(), torch.zeros(b, 1, h, dtype=dtype, device=dev),
                           torch.full((b, 1), self.kv.reserved_pos, dtype=torch.long, device=dev),
                           torch.empty(0))
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernels)
                    for _ in range(2):
                        self.fn(g.x, g.pos, None, self.kv, kv_limit=span)
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(g.graph, pool=self._pool):
                    g.out = self.fn(g.x, g.pos, None, self.kv, kv_limit=span)
                self._pool = g.graph.pool()
                self._graphs[(b, span)] = g

    @torch.no_grad()
    def run(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, reach: int | None = None) -> torch.Tensor:
        """x [N, H], pos [N], slots [N] (distinct) → final-norm hidden [N, H]. reach: max(pos) + 1."""
        dev = self.kv.k[0].device
        rows = _bucket(int(slots.max()) + 1, self.batch_buckets)  # slots live on the host: no sync
        pos, slots = pos.to(dev, non_blocking=True), slots.to(dev, non_blocking=True)
        span = _bucket(reach if reach is not None else self.kv.max_len, self.kv_buckets)
        g = self._graphs[(rows, span)]
        dense_x, dense_pos = dense_inputs(self.kv, x.to(dev, g.x.dtype), pos, slots, rows)
        g.x.copy_(dense_x)
        g.pos.copy_(dense_pos)
        g.graph.replay()
        return g.out[slots, 0]  # advanced indexing copies out of the graph's buffer
