"""The batched streaming encoder's layers in CUDA graphs, one per (batch bucket, span bucket).

Eager, the encoder's 24 layers dispatch about 400 small kernels per call from Python: on the H200 the front end
took 13.2 ms for one unit and 11.1 ms for 32 (bench/RESULTS.md, stop 24), so the host, not the GPU, set its
time, and it ran inside every stage0 prefill step. Captured, a call is a few input copies and one replay.

A graph runs the same per-layer code as the eager path (`engine/audio/batched.py` `_layer`) over static
inputs: the units' embedded frames x [b, S, d], their pool slots [b], new positions [b, S] and cache lengths
[b]. It reads the KV through the pool gather (the slots are data, not part of the graph), except for a batch
of the whole pool in slot order, whose graph reads the pool in place (at 64 units the gather cost 3 ms: 18.7
vs 15.6 ms eager on the H200). It always masks each row to its own past + unit, over `span` keys (the bucket,
at least the batch's longest past + S).
Padding rows (a batch below its bucket) write to the pool's scratch slot and read only their own S keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.audio.batched import PoolKV, attention_kernels, encoder_layer
from engine.cuda_graph import StaticGraph
from engine.model.audio import AudioKVPool, WhisperEncoder

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SPAN_QUANTUM = 250  # encoder frames (5 s of audio): a call attends over at most 249 masked keys more


def span_buckets(capacity: int, quantum: int = SPAN_QUANTUM) -> tuple[int, ...]:
    """Multiples of `quantum` below the pool's capacity, and the capacity itself."""
    return tuple(range(quantum, capacity, quantum)) + (capacity,)


def batch_buckets(slots: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The buckets below the pool's slot count, and the slot count (a full pool is one call)."""
    return tuple(sorted({b for b in buckets if b < slots} | {slots}))


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= value), None)


class EncoderGraphs:
    """Captured encoder steps over one `AudioKVPool`. `eager_replay` runs the same static-input step without
    capturing (CPU tests of the bucketing, padding and masking; nothing else changes)."""

    def __init__(self, encoder: WhisperEncoder, pool: AudioKVPool, frames: int, *,
                 eager_replay: bool = False) -> None:
        self.encoder, self.pool, self.frames = encoder, pool, frames
        self.eager_replay = eager_replay
        self.batches = batch_buckets(pool.slots)
        self.spans = span_buckets(pool.k.shape[3])
        self._graphs: dict[tuple[int, int, bool], StaticGraph] = {}
        self._static: dict[tuple[int, int, bool], tuple[torch.Tensor, ...]] = {}
        self._fill: dict[int, tuple[torch.Tensor, ...]] = {}  # padding rows' inputs per batch bucket
        self._mem = None

    @property
    def device(self) -> torch.device:
        return self.pool.k.device

    def keys(self) -> list[tuple[int, int, bool]]:
        """Every (batch, span, whole pool in place) bucket, largest first (captures share one memory pool)."""
        full = [(self.pool.slots, s, True) for s in sorted(self.spans, reverse=True)]
        return full + [(b, s, False) for b in sorted(self.batches, reverse=True) for s in sorted(self.spans, reverse=True)]

    @torch.inference_mode()  # else each captured output would keep its step's autograd activations alive
    def capture(self, emit: Callable[[str], None] | None = None) -> None:
        """Build every bucket now (warm-up), with one progress line per batch bucket."""
        keys = self.keys()
        for i, key in enumerate(keys):
            self._build(key)
            if emit is not None and (i + 1 == len(keys) or keys[i + 1][0] != key[0]):
                emit(f"audio encoder graphs: batch {key[0]}{' (whole pool)' if key[2] else ''}, {len(self.spans)} spans")

    def covers(self, rows: int, span: int) -> bool:
        return bucket(rows, self.batches) is not None and bucket(span, self.spans) is not None

    def _inputs(self, b: int) -> tuple[torch.Tensor, ...]:
        d, dev = self.encoder.layer_norm.weight.shape[0], self.device
        dtype = self.encoder.conv1.weight.dtype
        x = torch.zeros(b, self.frames, d, dtype=dtype, device=dev)
        slots = torch.full((b,), self.pool.scratch, dtype=torch.long, device=dev)
        at = torch.arange(self.frames, device=dev).repeat(b, 1)  # [b, S]
        starts = torch.zeros(b, dtype=torch.long, device=dev)
        return x, slots, at, starts

    def _step(self, span: int, whole: bool) -> Callable[..., tuple[torch.Tensor]]:
        def step(x: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor]:
            keys = torch.arange(span, device=x.device)
            mask = (keys[None] < (starts + x.shape[1])[:, None])[:, None, None, :]  # [b, 1, 1, span]
            kv = PoolKV(self.pool, slots, at, slice(0, self.pool.slots) if whole else None)
            with attention_kernels(x.device):
                for i, layer in enumerate(self.encoder.layers):
                    x = encoder_layer(layer, x, kv, i, span, mask)
            return (self.encoder.layer_norm(x),)
        return step

    def _build(self, key: tuple[int, int, bool]) -> None:
        if key in self._static:
            return
        inputs = self._inputs(key[0])
        self._static[key] = inputs
        if self.eager_replay:
            return
        if self._mem is None:
            self._mem = torch.cuda.graph_pool_handle()
        # in_place: none; the pool itself is read and written where it lies (a module attribute, not an input)
        self._graphs[key] = StaticGraph(self._step(key[1], key[2]), inputs, self._mem)

    @torch.inference_mode()
    def run(self, x: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, starts: torch.Tensor,
            span: int, whole: bool = False) -> torch.Tensor:
        """x [B, S, d], slots [B], at [B, S], starts [B] (on the device) -> post-LN hidden [B, S, d] (owned).
        `whole`: the batch is every slot of the pool in slot order (the caller knows it from its host list)."""
        n = x.shape[0]
        b, s = bucket(n, self.batches), bucket(span, self.spans)
        if b is None or s is None:
            raise ValueError(f"no encoder graph for {n} rows over {span} keys")
        if whole and n != self.pool.slots:
            raise ValueError(f"a whole-pool batch has {self.pool.slots} rows, not {n}")
        key = (b, s, whole)
        self._build(key)
        static = self._static[key]
        if b not in self._fill:
            self._fill[b] = self._inputs(b)
        # straight into the static inputs: padding rows (scratch slot, positions 0..S-1, no past) after the batch
        for dst, src, pad in zip(static, (x, slots, at, starts), self._fill[b], strict=True):
            dst[:n].copy_(src)
            dst[n:].copy_(pad[n:])
        if self.eager_replay:
            return self._step(s, whole)(*static)[0][:n].clone()
        graph = self._graphs[key]
        graph.graph.replay()
        return graph.outputs[0][:n].clone()
