"""CUDA graphs for the ragged flow: the estimator solve (`solve_ragged`, all Euler steps in one graph)
and the conformer encoder (`encode_ragged`; eager, its few hundred small kernels made batch 1
launch-bound: 35 ms per chunk against 19 ms of GPU work on the H200).

A graph is keyed by the batch's shapes (rows, frames, estimator window Tg, steps); the rows are bucketed
(`rows`, buckets.py) and the caller fixes the other widths (pooled.py), so graphs exist per row bucket and
token input width, not per batch size or history. The
estimator K/V is by far the largest state ([S, n_ts, depth, 2, H, W, 2hd], pool.py: n_ts · 128 KiB per
frame and slot in float32, 210 MiB per slot at float16 and the full W = 672). Every solve graph reads
and writes the pool tensor itself, in place (its pointer never changes): per Euler step it gathers the
rows' windows [0, Tg) into a one-step batch tensor (a graph-pool intermediate, reused step to step),
the step scatters its new K/V into it and attends under a per-row key mask, and an index_put writes
every frame's new K/V back at `wpos` (padded frames and dummy rows into column Tg − 1, which no slot
uses and no key mask reads before a call writes it). Warm-up runs rewrite the same K/V (idempotent).
Before, the caller copied all n_ts steps of every row's window into one shared buffer first: B · 210
MiB at float16, 13 GiB at 64 rows; now the window is B · 42 MiB, and only while a solve runs.
The other inputs are copied in at replay; their static copies are not per graph either but shared by
the graphs of a kind (static_io.py). That matters for the conformer history (≈ 10 MiB per row at full
window, float16) and the estimator conv caches (0.6 MiB per row), which per graph came to GBs. Outputs
(μ, new K/V, mel, cnn caches) are scratch that the caller copies into session storage before the next
replay (§6.8); they too are shared per kind, so the replay of ANY graph of that kind overwrites them.
On CPU, or when disabled, `solve` and `encode` run eagerly and `rows(n)` is n.

Token2Wav memory at full size, float16 flow, P ≤ 500 (W = 672 estimator frames):
  per session (pool slot, pool.py)   estimator K/V 210 MiB + conformer K/V 9 MiB + conv caches 0.6 MiB
  per batch row (max_batch)          static inputs ≈ 10.6 MiB + outputs ≈ 1.4 MiB (flow) + ≈ 1.3 MiB (HiFT,
                                     float32) + the solve's one-step window 42 MiB while it runs
  per graph                          the captured graph only (inputs, outputs, K/V window are shared)
  fixed                              weights, CUDA context, the graph pool's intermediates (largest bucket)
At 32 sessions: 7.0 GiB of slots + ≈ 1.7 GiB per-row buffers + fixed; at 64: 14.0 + ≈ 3.5 GiB + fixed.
Before the buckets: 32 batch sizes × ~11 graphs each held their own static inputs and outputs (the
conformer history ≈ 10 MiB per row and graph) and a 32 × 210 MiB K/V window buffer: 42.1 GB measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cuda_graph import StaticGraph
from engine.token2wav.buckets import bucket_rows
from engine.token2wav.cfm import solve_ragged
from engine.token2wav.dit import DiT
from engine.token2wav.flow import Flow
from engine.token2wav.ragged import encode_ragged
from engine.token2wav.static_io import StaticIO
from engine.warmup import GraphMisses

KV_INPUT = 4     # position of the pool's estimator K/V in the solver's input tuple (read and written in place)
TOK_INPUT, MEL_INPUT = 4, 6   # positions of the conformer histories in the encoder's input tuple


def step_window(est: torch.Tensor, slot: torch.Tensor, tg: int, wpos: torch.Tensor
                ) -> tuple[Callable[[int], torch.Tensor], Callable[[int, torch.Tensor], None]]:
    """(load, store) of one Euler step's K/V window over pool slots: est [S, n_ts, depth, 2, H, W, 2hd],
    slot [B], wpos [B, F] (the new frames' columns, the same for the cond and uncond rows)."""
    depth, b = est.shape[2], slot.shape[0]
    d_idx = torch.arange(depth, device=slot.device)[:, None, None]
    c_idx = torch.arange(2, device=slot.device)[None, :, None]
    r_idx = torch.arange(b, device=slot.device)[:, None]

    def load(step: int) -> torch.Tensor:
        # [S, depth, 2, H, tg, 2hd][slot, d, c] → [depth, 2, B, H, tg, 2hd] → [depth, 2B, H, tg, 2hd]
        window = est[:, step, :, :, :, :tg][slot[None, None, :], d_idx, c_idx]
        return window.view(depth, 2 * b, *window.shape[3:])

    def store(step: int, window: torch.Tensor) -> None:
        # [depth, 2, B, H, tg, 2hd][:, :, row, :, col] → [B, F, depth, 2, H, 2hd] → pool[slot, step, ..., col]
        new = window.view(depth, 2, b, *window.shape[2:])[:, :, r_idx, :, wpos]
        est[:, step][slot[:, None], :, :, :, wpos] = new
    return load, store


class RaggedSolver:
    """`solve_ragged` with the DiT and `encode_ragged`, eager or from graphs (at most `max_graphs`
    of each, then eager). With graphs a batch of n rows runs at `rows(n)`, the smallest of `buckets`."""

    def __init__(self, dit: DiT, enabled: bool, max_graphs: int = 32, buckets: tuple[int, ...] = ()) -> None:
        self.dit, self.max_graphs, self.buckets = dit, max_graphs, buckets
        self.enabled = enabled and torch.cuda.is_available() and next(dit.parameters()).is_cuda
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.graphs: dict[tuple, StaticGraph] = {}
        self.enc_graphs: dict[tuple, StaticGraph] = {}
        self.io = StaticIO()                    # static inputs / outputs, shared by the graphs of a kind
        self.misses = GraphMisses("token2wav")  # the engine shares one across its graph caches

    def rows(self, n: int) -> int:
        """Batch rows for n real rows: the row bucket with graphs (dummy rows pad it), n eagerly."""
        return bucket_rows(n, self.buckets) if self.enabled and self.buckets else n

    def reserve(self, kind: str, position: int, numel: int, like: torch.Tensor) -> None:
        """Size the static storage of input `position` of `kind` ("solve" / "encode") for its largest
        shape up front (warm-up): graphs captured before a later growth would keep the smaller one."""
        if self.enabled:
            self.io.reserve(kind, position, numel, like)

    def solve(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, n_timesteps: int, cfg_rate: float,
              cnn: torch.Tensor, est_att: torch.Tensor, key_mask: torch.Tensor, wpos: torch.Tensor,
              cnn_end: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`solve_ragged` over the pool's estimator K/V `est_att` [S, n_ts, depth, 2, H, W, 2hd], read and
        written in place: per step, rows' windows [0, Tg) of slots `slot` [B] are gathered into a one-step
        buffer and the step's new K/V (every frame at `wpos`, padded ones at Tg − 1) scattered back."""
        def fn(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor, c: torch.Tensor, est: torch.Tensor,
               mask: torch.Tensor, w: torch.Tensor, e: torch.Tensor, rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
            load, store = step_window(est, rows, mask.shape[1], w[: rows.shape[0]])
            return solve_ragged(self.dit.forward_ragged, x, m, s, n_timesteps, cfg_rate, c, load, mask, w, e, store)

        inputs = (noise, mu, spks, cnn, est_att, key_mask, wpos, cnn_end, slot)
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

    def _replay(self, graphs: dict[tuple, StaticGraph], kind: str, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]],
                inputs: tuple[torch.Tensor, ...], shared: int | None) -> tuple[torch.Tensor, ...]:
        graph = graphs.get(key)
        if graph is None:
            # after warm-up a missing shape runs eager: capturing on live traffic stalled every session's audio
            # (a flow encode + solve capture took 1.4 s on the H200, stop 26); eager costs tens of ms, once per call
            eager = len(graphs) >= self.max_graphs or self.misses.warm
            self.misses.record(kind, key, "eager" if eager else "captured now")
            if eager:
                return fn(*inputs)
            graph = graphs[key] = StaticGraph(self.io.outputs(kind, fn), self.io.inputs(kind, inputs, shared), self.pool,
                                         shared)
        return graph.run(inputs)
