"""CUDA graphs for the Stage0 forward steps (STYLE.md practice 5): decode and unit prefill.

Every captured shape is a `StaticStep`: static input buffers padded with dummy rows, a static output, and
a `replay`. A run is copy-in → replay → copy-out into tensors the caller owns (the next replay overwrites
the static output). All graphs of one set share a memory pool.

- `DecodeGraphs`: single-token rows in the dense layout (row i = KV slot i, attention reads the cache as a
  view), one graph per (batch bucket ≥ highest live slot + 1, attention-span bucket). Idle rows write to
  `kv.reserved_pos`.
- `PrefillGraphs`: multi-token rows (a unit `<unit>` + frames + audio, optionally after the previous unit's
  `[terminator, </unit>]`, or a separate 2-position close) in the gathered layout, one graph per
  (batch bucket, length bucket, span bucket). Dummy rows and padded positions write to the scratch slot.
  With `flex` the rows up to `FLEX_MAX_POSITIONS` long (every unit, frames included) attend over the cache
  itself (FlexAttention, engine/model/flex.py): no KV copy, one span bucket.
- `SharedGraphs`: a step with both kinds in one pass over the weights (`Qwen3LLM.forward_shared`): unit rows
  as in the prefill graphs, single-token rows as in the decode graphs (same dense bucket, same span, same
  attention), one graph per (unit batch bucket, length, dense batch bucket, decode span, unit span).

Off CUDA (or with `eager_replay=True`) `replay` calls the step function on the same static buffers, so CPU
tests exercise the bucketing and copy-in/copy-out logic. `compile_mode` runs the forward's decoder layers
`torch.compile`d before capture (regional compilation: one layer compiled once for every layer, decode and
prefill, with symbolic sizes: a few compiles for all buckets); modes that bring their own CUDA graphs are
refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cuda_graph import capture
from engine.hostio import to_device
from engine.model.layers import LayerFn, compile_layers, mark_static_kv
from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0.config import COMPILE_MODES

# Longest rows the prefill graphs run with FlexAttention: a unit with two camera frames (13 + 2 x 66 positions).
# Rows past 16 positions use flex's attention kernel (engine/model/flex.py); its decoding kernel found no valid
# configuration for 79-position rows on the H200 (stop 26). A 13-position unit prefill at 8 k: 13.3 -> 7.7 ms.
FLEX_MAX_POSITIONS = 160

# A graph pads the forward's GEMMs to the rows of its set's largest batch bucket (at its length), so a row's
# numbers do not depend on the bucket its step lands in: cuBLAS picks its kernel by the row count, and on the
# H200 in bf16 the o_proj / down GEMMs of 64 rows differed from those of 32, a unit prefill among 4 or 8 units
# from the same unit among 2 (bench/batch_invariance_ops.py, bench/RESULTS.md stop 37). Up to this many rows:
# past it a GEMM is compute-bound and padding costs its full share, so graphs of longer rows (units with camera
# frames) keep the model's least rows (`Stage0Config.gemm_min_rows`; `gemm_pad_buckets` turns this off).
BUCKET_PAD_MAX_ROWS = 128


class GraphShapeError(RuntimeError):
    """Inputs do not fit the captured static buffers (shape, dtype or bucket drift)."""


@dataclass
class StaticStep:
    x: torch.Tensor  # [b, T, H]
    pos: torch.Tensor  # [b, T] absolute positions
    slots: torch.Tensor | None  # [b] (gathered layout) or None (dense: row i = slot i)
    valid: torch.Tensor | None  # [b, T] bool, gathered layout only
    span: int  # attention span (kv_limit)
    flex: bool = False  # gathered rows attend over the cache with FlexAttention (Qwen3LLM.forward's flex)
    out: torch.Tensor | None = None  # [b, T, H] final-norm hidden, written by replay
    replay: Callable[[], object] | None = None

    def check(self, rows: int, length: int, dtype: torch.dtype) -> None:
        b, t, _ = self.x.shape
        if rows > b or length > t or dtype != self.x.dtype:
            raise GraphShapeError(f"{rows} rows × {length} positions ({dtype}) do not fit the static "
                                  f"step {tuple(self.x.shape)} ({self.x.dtype})")


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    fits = [b for b in buckets if b >= value]
    if not fits:
        raise GraphShapeError(f"{value} exceeds the largest bucket {max(buckets)}")
    return min(fits)


def dense_layout(pos: torch.Tensor, slots: torch.Tensor, rows: int, idle_pos: int) -> torch.Tensor:
    """Host [rows + N]: each dense row's position (`idle_pos` for rows without a token), then the N tokens' slots."""
    dense_pos = torch.full((rows,), idle_pos, dtype=torch.long)
    dense_pos[slots] = pos
    return torch.cat([dense_pos, slots])


def fill_dense(x_st: torch.Tensor, pos_st: torch.Tensor, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Copy-in of a dense step: x [N, H] into its slots' rows of x_st [rows, 1, H], `dense_layout`'s positions into
    pos_st [rows, 1]. Returns the tokens' slots on the device (where their outputs are read)."""
    rows = x_st.shape[0]
    dev_slots = packed[rows:]
    x_st.zero_()
    x_st[dev_slots, 0] = x
    pos_st.copy_(packed[:rows, None])
    return dev_slots


def gathered_layout(slots: list[int], starts: list[int], lengths: list[int], rows: int, t: int,
                    scratch: int) -> torch.Tensor:
    """Host [rows, 2 t + 1]: [positions | valid | slot] per gathered row. Dummy rows and padding: the scratch slot,
    invalid (they write to scratch position 0 and read only themselves)."""
    host = torch.zeros(rows, 2 * t + 1, dtype=torch.long)
    host[:, -1] = scratch
    for i, (slot, start, k) in enumerate(zip(slots, starts, lengths, strict=True)):
        host[i, :k] = torch.arange(start, start + k)
        host[i, t:t + k] = 1
        host[i, -1] = slot
    return host


def fill_gathered(x_st: torch.Tensor, pos_st: torch.Tensor, valid_st: torch.Tensor, slots_st: torch.Tensor,
                  packed: torch.Tensor, embeds: list[torch.Tensor]) -> None:
    """Copy-in of gathered rows: embeds[i] [T_i, H] into x_st [rows, t, H], `gathered_layout` (on the device) into
    the position, valid and slot buffers."""
    t = x_st.shape[1]
    x_st.zero_()
    for i, e in enumerate(embeds):
        x_st[i, :e.shape[0]] = e
    pos_st.copy_(packed[:, :t])
    valid_st.copy_(packed[:, t:2 * t].bool())
    slots_st.copy_(packed[:, -1])


def top_span_buckets(kv: SlotKVCache, spans: tuple[int, ...]) -> tuple[int, ...]:
    """Attention spans up to `kv.reserved_pos`, which covers every token's key (no token is ever at the
    reserved position). Not the cache length: a span of the whole cache is a contiguous slice, which a
    compiled layer would compile separately."""
    return tuple(sorted({b for b in spans if b < kv.reserved_pos} | {kv.reserved_pos}))


def compile_step(mode: str | None, dynamic: bool | None = True) -> LayerFn | None:
    """The layer function the graph sets pass to the forward: None (eager) or the decoder layer compiled
    once for all layers (regional compilation, `compile_layers`); with dynamic=True the batch, length
    and span are symbolic from the first compile, so the buckets share a few compiles. Rounded as eager
    rounds (`compile_symbolic`'s eager_rounding): a row's bits then do not follow the graph it runs in (decode,
    prefill or shared pass)."""
    if mode is None:
        return None
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: use one of {COMPILE_MODES} (the engine captures its own graphs)")
    return compile_layers(mode, dynamic, eager_rounding=True)


class StepGraphs:
    """Static steps keyed by shape, captured once into one pool."""

    def __init__(self, model: Qwen3LLM, kv: SlotKVCache, compile_mode: str | None = None,
                 eager_replay: bool = False, compile_dynamic: bool | None = True,
                 decode_attention: str | None = None, pad_buckets: bool = True) -> None:
        self.model, self.kv = model, kv
        self.pad_buckets = pad_buckets  # GEMMs padded to the set's top rows (`gemm_rows`)
        self.decode_attention = decode_attention  # single-token rows' attention (None: the model's default)
        self.layer_fn = compile_step(compile_mode, compile_dynamic)
        if self.layer_fn is not None:
            mark_static_kv(kv)
        self.device = kv.k[0].device
        self.dtype = next(model.parameters()).dtype
        self.eager_replay = eager_replay or self.device.type != "cuda"
        self.steps: dict[tuple[int, ...], StaticStep] = {}
        self._pool = None

    def _step(self, key: tuple[int, ...]) -> StaticStep:
        st = self.steps.get(key)
        if st is None:
            raise GraphShapeError(f"no static step was captured for shape {key}")
        return st

    def _recompile_room(self) -> contextlib.AbstractContextManager:
        if self.layer_fn is None:
            return contextlib.nullcontext()  # not compiled: leave torch._dynamo unimported
        cfg = torch._dynamo.config
        return cfg.patch(recompile_limit=max(cfg.recompile_limit, cfg.accumulated_recompile_limit))

    def _call(self, st: StaticStep) -> torch.Tensor:
        return self.model(st.x, st.pos, st.slots, self.kv, valid=st.valid, kv_limit=st.span, layer_fn=self.layer_fn,
                          flex=st.flex, decode_attention=self.decode_attention)

    def _top_rows(self, key: tuple[int, ...]) -> int:
        """The GEMM rows of this set's largest graph at `key`'s length (0: no bucket padding)."""
        return 0

    def gemm_rows(self, key: tuple[int, ...]) -> int:
        """The least GEMM rows the graph at `key` runs with: its set's top rows rounded up to a power of two
        (`BUCKET_PAD_MAX_ROWS`). Rounded because on the H200 8 units of 13 positions, exactly 104 rows, differed
        from 2 or 4 units padded to 104 (0.109), while every count padded to 128 was equal (stop 37). A model that
        tiles its GEMMs (`Stage0Config.gemm_tile_rows`) runs every graph at its tile."""
        base, top = self.model.gemm_min_rows, self._top_rows(key) if self.pad_buckets and not self.model.tile else 0
        rows = 1 << max(top - 1, 0).bit_length()
        return rows if 0 < base < rows <= BUCKET_PAD_MAX_ROWS else base

    def _padded_call(self, st: StaticStep, rows: int) -> torch.Tensor:
        with self.model.gemm_rows(rows):
            return self._call(st)

    @torch.no_grad()
    def _capture(self, key: tuple[int, ...], st: StaticStep) -> None:
        # a new shape may recompile (every shape with dynamic=False, and the decode and prefill sets share the
        # layer's code object), so lift the per-code limit to the accumulated one while capturing; capture
        # is the only place the compiled function runs
        rows = self.gemm_rows(key)
        with self._recompile_room():
            if self.eager_replay:
                st.out = self._padded_call(st, rows).clone()
                st.replay = lambda: st.out.copy_(self._padded_call(st, rows))
            else:
                graph, st.out = capture(lambda: self._padded_call(st, rows), pool=self._pool)
                self._pool = graph.pool()
                st.replay = graph.replay
        self.steps[key] = st


class DecodeGraphs(StepGraphs):
    def __init__(self, model: Qwen3LLM, kv: SlotKVCache, batch_buckets: tuple[int, ...],
                 kv_buckets: tuple[int, ...], compile_mode: str | None = None, eager_replay: bool = False,
                 compile_dynamic: bool | None = True, decode_attention: str | None = None,
                 pad_buckets: bool = True) -> None:
        super().__init__(model, kv, compile_mode, eager_replay, compile_dynamic, decode_attention, pad_buckets)
        self.batch_buckets = tuple(sorted({min(b, kv.slots) for b in batch_buckets} | {kv.slots}))
        self.kv_buckets = top_span_buckets(kv, kv_buckets)
        if (decode_attention or model.decode_attention) == "flex":  # each row reads its own blocks: one span
            self.kv_buckets = self.kv_buckets[-1:]

    @classmethod
    def create(cls, model: Qwen3LLM, kv: SlotKVCache, batch_buckets: tuple[int, ...],
               kv_buckets: tuple[int, ...] = (), enabled: bool = True, compile_mode: str | None = None,
               eager_replay: bool = False, compile_dynamic: bool | None = True,
               decode_attention: str | None = None, pad_buckets: bool = True) -> DecodeGraphs | None:
        """None when disabled, or off CUDA unless `eager_replay` (tests)."""
        if not enabled or (kv.k[0].device.type != "cuda" and not eager_replay):
            return None
        graphs = cls(model, kv, batch_buckets, kv_buckets, compile_mode, eager_replay, compile_dynamic,
                     decode_attention, pad_buckets)
        graphs.capture()
        return graphs

    def _top_rows(self, key: tuple[int, ...]) -> int:
        return self.batch_buckets[-1]

    def capture(self) -> None:
        h = self.model.cfg.hidden_size
        # largest first so the shared pool is sized by the biggest graph
        for b in sorted(self.batch_buckets, reverse=True):
            for span in sorted(self.kv_buckets, reverse=True):
                st = StaticStep(x=torch.zeros(b, 1, h, dtype=self.dtype, device=self.device),
                                pos=torch.full((b, 1), self.kv.reserved_pos, dtype=torch.long, device=self.device),
                                slots=None, valid=None, span=span)
                self._capture((b, span), st)

    @torch.no_grad()
    def run(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, reach: int | None = None) -> torch.Tensor:
        """x [N, H] (device), pos [N] and slots [N] (host, distinct) → final-norm hidden [N, H] (owned).

        reach: max(pos) + 1, the positions attention must span (default: every token position of the slot)."""
        rows = bucket(int(slots.max()) + 1, self.batch_buckets)
        span = bucket(self.kv.reserved_pos if reach is None else reach, self.kv_buckets)
        st = self._step((rows, span))
        st.check(rows, 1, x.dtype)
        packed = to_device(dense_layout(pos, slots, rows, self.kv.reserved_pos), self.device)  # one host → device copy
        dev_slots = fill_dense(st.x, st.pos, packed, x)
        st.replay()
        assert st.out is not None
        return st.out[dev_slots, 0]  # advanced indexing copies out of the static output


class PrefillGraphs(StepGraphs):
    def __init__(self, model: Qwen3LLM, kv: SlotKVCache, batch_buckets: tuple[int, ...],
                 len_buckets: tuple[int, ...], kv_buckets: tuple[int, ...], compile_mode: str | None = None,
                 eager_replay: bool = False, compile_dynamic: bool | None = True, flex: bool = False,
                 pad_buckets: bool = True) -> None:
        super().__init__(model, kv, compile_mode, eager_replay, compile_dynamic, pad_buckets=pad_buckets)
        self.batch_buckets = tuple(sorted({min(b, kv.slots) for b in batch_buckets}))
        self.len_buckets = tuple(sorted(set(len_buckets)))
        self.kv_buckets = top_span_buckets(kv, kv_buckets)
        # lengths that attend with flex: each row reads its own blocks whatever the span, so one (top) span each
        self.flex_lengths = {t for t in self.len_buckets if t <= FLEX_MAX_POSITIONS} if flex else set()

    def spans(self, length: int) -> tuple[int, ...]:
        return self.kv_buckets[-1:] if length in self.flex_lengths else self.kv_buckets

    @classmethod
    def create(cls, model: Qwen3LLM, kv: SlotKVCache, batch_buckets: tuple[int, ...],
               len_buckets: tuple[int, ...], kv_buckets: tuple[int, ...] = (), enabled: bool = True,
               compile_mode: str | None = None, eager_replay: bool = False,
               compile_dynamic: bool | None = True, flex: bool = False,
               pad_buckets: bool = True) -> PrefillGraphs | None:
        if not enabled or not batch_buckets or not len_buckets or (
                kv.k[0].device.type != "cuda" and not eager_replay):
            return None
        graphs = cls(model, kv, batch_buckets, len_buckets, kv_buckets, compile_mode, eager_replay,
                     compile_dynamic, flex, pad_buckets)
        graphs.capture()
        return graphs

    def capture(self) -> None:
        h, dev = self.model.cfg.hidden_size, self.device
        for b in sorted(self.batch_buckets, reverse=True):
            for t in sorted(self.len_buckets, reverse=True):
                for span in sorted(self.spans(t), reverse=True):
                    st = StaticStep(x=torch.zeros(b, t, h, dtype=self.dtype, device=dev),
                                    pos=torch.zeros(b, t, dtype=torch.long, device=dev),
                                    slots=torch.full((b,), self.kv.scratch, dtype=torch.long, device=dev),
                                    valid=torch.zeros(b, t, dtype=torch.bool, device=dev), span=span,
                                    flex=t in self.flex_lengths)
                    self._capture((b, t, span), st)

    def _top_rows(self, key: tuple[int, ...]) -> int:
        return self.batch_buckets[-1] * key[1]  # key: (batch, length, span)

    def covers(self, rows: int, length: int) -> bool:
        return rows <= self.batch_buckets[-1] and length <= self.len_buckets[-1]

    @torch.no_grad()
    def run(self, slots: list[int], starts: list[int], embeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Row i: `embeds[i]` [T_i, H] at positions starts[i]… of slot slots[i] → hidden [T_i, H] (owned)."""
        n, lengths = len(slots), [e.shape[0] for e in embeds]
        b, t = bucket(n, self.batch_buckets), bucket(max(lengths), self.len_buckets)
        span = bucket(max(s + k for s, k in zip(starts, lengths, strict=True)), self.spans(t))
        st = self._step((b, t, span))
        st.check(n, max(lengths), embeds[0].dtype)
        packed = to_device(gathered_layout(slots, starts, lengths, b, t, self.kv.scratch), self.device)  # one copy
        assert st.slots is not None and st.valid is not None
        fill_gathered(st.x, st.pos, st.valid, st.slots, packed, embeds)
        st.replay()
        assert st.out is not None
        out = st.out[:n].clone()  # [n, t, H], owned by the caller
        return [out[i, :k] for i, k in enumerate(lengths)]


@dataclass
class SharedStep:
    """The static buffers of one shared pass: gathered unit rows, then dense token rows."""

    xu: torch.Tensor  # [bu, t, H]
    pos_u: torch.Tensor  # [bu, t]
    slots_u: torch.Tensor  # [bu]
    valid_u: torch.Tensor  # [bu, t]
    xd: torch.Tensor  # [bd, 1, H]
    pos_d: torch.Tensor  # [bd, 1]
    span_u: int
    span_d: int
    flex: bool
    out: torch.Tensor | None = None  # [bu t + bd, H]
    replay: Callable[[], object] | None = None


class SharedGraphs(StepGraphs):
    """Steps with unit rows of up to `length` positions and single-token rows, in one pass over the weights. The
    buckets, spans and attention come from the engine's decode and prefill graph sets, so a token row is laid out
    and attends as in its decode graph (its numbers are the decode graph's) and a unit row as in the prefill graph.
    Dense buckets up to `top_rows` rows."""

    def __init__(self, decode: DecodeGraphs, prefill: PrefillGraphs, length: int, top_rows: int,
                 compile_mode: str | None = None, eager_replay: bool = False,
                 compile_dynamic: bool | None = True) -> None:
        super().__init__(prefill.model, prefill.kv, compile_mode, eager_replay, compile_dynamic,
                         decode.decode_attention)
        self.unit_buckets, self.length = prefill.batch_buckets, bucket(length, prefill.len_buckets)
        self.unit_spans, self.flex = prefill.spans(self.length), self.length in prefill.flex_lengths
        self.decode_buckets = tuple(b for b in decode.batch_buckets if b <= top_rows)
        self.decode_spans = decode.kv_buckets

    @classmethod
    def create(cls, decode: DecodeGraphs | None, prefill: PrefillGraphs | None, length: int, top_rows: int,
               enabled: bool = True, compile_mode: str | None = None, eager_replay: bool = False,
               compile_dynamic: bool | None = True) -> SharedGraphs | None:
        """None when disabled, or without both graph sets (off CUDA unless they replay eagerly)."""
        if not enabled or decode is None or prefill is None or not any(b <= top_rows for b in decode.batch_buckets):
            return None
        graphs = cls(decode, prefill, length, top_rows, compile_mode, eager_replay, compile_dynamic)
        graphs.capture()
        return graphs

    def capture(self) -> None:
        h, dev, dt, t = self.model.cfg.hidden_size, self.device, self.dtype, self.length
        for bu in sorted(self.unit_buckets, reverse=True):
            for bd in sorted(self.decode_buckets, reverse=True):
                for span_d in sorted(self.decode_spans, reverse=True):
                    for span_u in sorted(self.unit_spans, reverse=True):
                        st = SharedStep(
                            xu=torch.zeros(bu, t, h, dtype=dt, device=dev),
                            pos_u=torch.zeros(bu, t, dtype=torch.long, device=dev),
                            slots_u=torch.full((bu,), self.kv.scratch, dtype=torch.long, device=dev),
                            valid_u=torch.zeros(bu, t, dtype=torch.bool, device=dev),
                            xd=torch.zeros(bd, 1, h, dtype=dt, device=dev),
                            pos_d=torch.full((bd, 1), self.kv.reserved_pos, dtype=torch.long, device=dev),
                            span_u=span_u, span_d=span_d, flex=self.flex)
                        self._capture((bu, t, bd, span_d, span_u), st)  # type: ignore[arg-type]

    def _call(self, st: SharedStep) -> torch.Tensor:  # type: ignore[override]
        return self.model.forward_shared(st.xu, st.pos_u, st.slots_u, st.valid_u, st.xd, st.pos_d, self.kv,
                                         limit_u=st.span_u, limit_d=st.span_d, layer_fn=self.layer_fn, flex=st.flex,
                                         decode_attention=self.decode_attention)

    def covers(self, units: int, length: int, top_token_slot: int) -> bool:
        """Whether `units` unit rows of at most `length` positions and token rows up to slot `top_token_slot` fit."""
        return units <= self.unit_buckets[-1] and length <= self.length and top_token_slot < self.decode_buckets[-1]

    @torch.no_grad()
    def run(self, slots: list[int], starts: list[int], embeds: list[torch.Tensor], x: torch.Tensor,
            pos: torch.Tensor, token_slots: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Unit row i: `embeds[i]` [T_i, H] at starts[i]… of slot slots[i] (as `PrefillGraphs.run`); token rows:
        x [N, H] (device) at pos [N] of token_slots [N] (host, distinct; as `DecodeGraphs.run`) → (each unit row's
        hidden [T_i, H], the token rows' hidden [N, H]), owned."""
        n, lengths, t = len(slots), [e.shape[0] for e in embeds], self.length
        bu = bucket(n, self.unit_buckets)
        span_u = bucket(max(s + k for s, k in zip(starts, lengths, strict=True)), self.unit_spans)
        bd = bucket(int(token_slots.max()) + 1, self.decode_buckets)
        span_d = bucket(int(pos.max()) + 1, self.decode_spans)  # the decode graphs' reach rule
        st = self.steps.get((bu, t, bd, span_d, span_u))
        if st is None:
            raise GraphShapeError(f"no shared step was captured for shape {(bu, t, bd, span_d, span_u)}")
        if max(lengths) > t or embeds[0].dtype != st.xu.dtype or x.dtype != st.xd.dtype:
            raise GraphShapeError(f"{n} unit rows x {max(lengths)} positions do not fit {tuple(st.xu.shape)}")
        units = gathered_layout(slots, starts, lengths, bu, t, self.kv.scratch)
        packed = to_device(torch.cat([units.flatten(), dense_layout(pos, token_slots, bd, self.kv.reserved_pos)]),
                           self.device)  # one host → device copy
        fill_gathered(st.xu, st.pos_u, st.valid_u, st.slots_u, packed[:units.numel()].view(units.shape), embeds)
        dev_slots = fill_dense(st.xd, st.pos_d, packed[units.numel():], x)
        assert st.replay is not None
        st.replay()
        assert st.out is not None
        hu = st.out[:n * t].reshape(n, t, -1).clone()
        return [hu[i, :k] for i, k in enumerate(lengths)], st.out[bu * t:][dev_slots]
