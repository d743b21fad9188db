"""The Stage0 sampler in CUDA graphs (STYLE.md practice 5): the penalty mask and `sample`, one graph per batch bucket.

The sampler is some sixty small kernels over [B, V] (the B2 mask from the history ring, Step A, B1-B6 with the
candidate rule), timed at 2.6-3.4 ms a step on the H200 when launched one by one (stop 31, device synchronised
around them); a replay launches them at once. Served, the graphs shortened a stage0 step by 1.3-2.8 ms at 32-64
sessions (bench/RESULTS.md, stop 32 item 3). Only the candidate rule is captured: a row whose top-k does not fit
the candidates (rare) is drawn again eagerly by the caller.

Rows past the live ones are greedy dummies at ring slot 0 with an empty history. Every sampler op works within
its row, so they change no live row. The graph reads the ring's ids tensor where it lies: a ring that grows (a
session asking for a wider window than any before) leaves the graphs stale, and the sampler runs eagerly from
then on (`covers`). Off CUDA (or with `eager_replay`) a replay calls the same function on the same static
buffers, so CPU tests run the bucketing and the copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cuda_graph import capture
from engine.hostio import to_device
from engine.stage0.graphs import bucket
from engine.stage0.penalty import HistoryRing
from engine.stage0.sampling import SamplerIds, SamplingBatch, SamplingParams, sample, table_rows

# A dummy row of `table_rows` [1, 13]: greedy, neutral parameters, ring slot 0 with no history, window 1
PAD_ROW = table_rows([SamplingParams(greedy=True, temperature=1.0, top_k=1, top_p=1.0, repetition_penalty=1.0,
                                     turn_eos_length_penalty=1.0, repetition_window=1)], [[0.5, 0.5]], [0], [0])


@dataclass
class StaticSample:
    logits: torch.Tensor  # [b, V] in the model dtype
    table: torch.Tensor  # [b, 13] fp64, `table_rows` on the device
    out: torch.Tensor | None = None  # [4, b] int64: token, draws, appended, exact (sample's outputs, stacked)
    replay: Callable[[], object] | None = None


class SamplerGraphs:
    def __init__(self, ring: HistoryRing, ids: SamplerIds, vocab: int, dtype: torch.dtype,
                 buckets: tuple[int, ...], eager_replay: bool = False) -> None:
        self.ring, self.ids = ring, ids
        self.device = ring.device
        self.buckets = tuple(sorted(set(buckets)))
        self.eager_replay = eager_replay or self.device.type != "cuda"
        self._ring_ids = ring.ids  # the tensor the graphs read
        self.steps: dict[int, StaticSample] = {}
        pool = None
        for b in sorted(self.buckets, reverse=True):  # largest first: it sizes the shared pool
            st = StaticSample(logits=torch.zeros(b, vocab, dtype=dtype, device=self.device),
                              table=to_device(PAD_ROW.repeat(b, 1), self.device))
            if self.eager_replay:
                st.out = self._call(st).clone()
                st.replay = lambda st=st: st.out.copy_(self._call(st))  # type: ignore[union-attr]
            else:
                graph, st.out = capture(lambda st=st: self._call(st), pool=pool)
                pool = graph.pool()
                st.replay = graph.replay
            self.steps[b] = st

    @classmethod
    def create(cls, ring: HistoryRing, ids: SamplerIds, vocab: int, dtype: torch.dtype, buckets: tuple[int, ...],
               enabled: bool = True, eager_replay: bool = False) -> SamplerGraphs | None:
        """None when disabled, or off CUDA unless `eager_replay` (tests)."""
        if not enabled or (ring.device.type != "cuda" and not eager_replay):
            return None
        with torch.no_grad():
            return cls(ring, ids, vocab, dtype, buckets, eager_replay)

    def _call(self, st: StaticSample) -> torch.Tensor:
        return torch.stack(sample(st.logits, SamplingBatch.from_table(st.table, self.ring), self.ids)).long()

    def covers(self, rows: int) -> bool:
        return rows <= self.buckets[-1] and self.ring.ids is self._ring_ids

    @torch.no_grad()
    def run(self, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [n, V] (device), rows: `table_rows` [n, 13] (host) → (out [4, n], ring slots [n], history
        lengths [n]), views of the static buffers: read them before the next `run`."""
        n = logits.shape[0]
        st = self.steps[bucket(n, self.buckets)]
        st.table.copy_(to_device(torch.cat([rows, PAD_ROW.expand(st.table.shape[0] - n, -1)]), self.device))
        st.logits[:n].copy_(logits)
        st.replay()
        assert st.out is not None
        return st.out[:, :n], st.table[:n, 10].long(), st.table[:n, 11].long()
