"""TTS model runner: the only owner of the TTS KV tensors and the CUDA graphs.

`run_unit` runs one speaking unit for B sessions with no host sync: one ragged condition-row prefill
that draws sample 0, then `max_new_tokens - 1` single-code steps, each reading its inputs from a
static `UnitState` at a device step counter and sampling in place from per-row uniforms. EOS rows keep
stepping (their extra KV lies past the unit's end and is overwritten before it is ever attended); the
engine trims after the single copy-out. With a `head`, the unit's first samples also come back early, behind
an event, so a turn's first codes can leave before its last are drawn (`TTSEngineConfig.first_codes`).

On CUDA the step replays a graph per (batch bucket, kv bucket) and the prefill one per (batch bucket,
row bucket, kv bucket), padded with scratch-slot rows; with `compile_step` the step's decoder layers
run torch.compile'd before capture (fewer, fused kernels; regional compilation: one layer compiled once
for all layers and all buckets, `compile_layers`). `warm_up` builds all of them at load (the stage is
ready only after); later, a shape that finds no graph is a `misses` entry (counted, logged once). On CPU
both run without graphs through the same functions (the step's layers compiled with `compile_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cuda_graph import capture
from engine.model.layers import LayerFn, allow_recompiles, compile_layers, compile_symbolic, mark_static_kv
from engine.model.tts import TTSKVCache, TTSModel
from engine.stage1.config import TTSEngineConfig
from engine.stage1.sampling import tts_sample
from engine.stage1.state import UnitState
from engine.warmup import GraphMisses, Progress


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    cond: torch.Tensor | None  # [B, T, H] static condition rows (prefill graphs only)


class TTSRunner:
    def __init__(self, model: TTSModel, cfg: TTSEngineConfig, *, dtype: torch.dtype) -> None:
        self.model, self.cfg = model, cfg
        self.device = model.emb_text.weight.device
        self.vocab = model.cfg.num_audio_tokens
        # one spare position past the largest kv bucket: a span of the whole cache is a contiguous slice,
        # which the compiled layer would compile separately
        self.kv = TTSKVCache.allocate(model.cfg, cfg.max_sessions, cfg.max_turn_positions + 1,
                                      dtype=dtype, device=self.device)
        on_cuda = self.device.type == "cuda"
        self.use_graphs = cfg.use_cuda_graphs and on_cuda
        self._states: dict[int, UnitState] = {}  # per batch bucket, shared by its graphs
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self._lane_state: UnitState | None = None  # continuous engine only (`_lanes`)
        self._in_flight: list[torch.cuda.Event] = []  # lane steps launched and not yet known finished
        self._pool: object | None = None
        self.misses = GraphMisses("tts")
        self._layer_fn: LayerFn | None = None
        self._head_fn: Callable[..., torch.Tensor] = self._head
        if cfg.compile_step:  # fuse the ~45 small kernels per layer; graphs replay the result
            allow_recompiles(8)
            # NOTE: regional compilation: one decoder layer is compiled once and runs all layers, with the
            # batch and kv span symbolic from the start, so warm-up compiles it twice (batch 1 and batch > 1)
            # rather than the whole step per (batch, kv) shape. Graphs still replay per bucket.
            self._layer_fn = compile_layers(dynamic=True)
            mark_static_kv(self.kv)
            # logits + sampling (~30 small kernels), compiled apart the same way: two more small compiles
            self._head_fn = compile_symbolic(self._head)

    # -- the two functions shared by eager and graph paths ----------------------------------------
    def _prefill(self, cond: torch.Tensor, st: UnitState, kv_limit: int) -> None:
        """Condition rows [B, T, H] at start .. start + n → sample 0 (from the audio_bos row)."""
        b, t_max, w = cond.shape[0], cond.shape[1], self.cfg.repetition_window
        row = torch.arange(t_max, device=cond.device)
        valid = (row[None] <= st.n_rows[:, None]) & st.valid[:, None]  # [B, T]
        pos = st.start[:, None] + row[None]  # [B, T]
        hidden = self.model(cond, pos, st.slot, self.kv, valid=valid, kv_limit=kv_limit)  # [B, T, H]
        logits = self.model.logits(hidden[torch.arange(b, device=cond.device), st.n_rows])  # [B, V]
        st.samples[:, :w].fill_(self.vocab)  # empty penalty window
        first = self._sample(logits, st.samples[:, :w], st, st.u[:, 0])  # t = 0: no penalty
        st.samples[:, w].copy_(first)
        st.t.fill_(1)

    def _step(self, st: UnitState, kv_limit: int) -> None:
        """Feed sample t-1 at start + n + t, draw sample t."""
        b, w = st.size, self.cfg.repetition_window
        t = st.t.expand(b)[:, None]  # [B, 1]
        code = st.samples.gather(1, t + (w - 1))[:, 0]  # [B]
        window = st.samples.gather(1, t + torch.arange(w, device=t.device))  # samples t-w .. t-1
        x = self.model.embed_codes(code)[:, None]  # [B, 1, H]
        pos = (st.start + st.n_rows + st.t)[:, None]  # [B, 1]
        h = self.model(x, pos, st.slot, self.kv, valid=st.valid[:, None], kv_limit=kv_limit,
                       layer_fn=self._layer_fn)
        out = self._head_fn(h[:, 0], window, st, st.u.gather(1, t)[:, 0])
        st.samples.scatter_(1, t + w, out[:, None])
        st.t.add_(1)
        if st.per_row:  # a lane past its unit's last step (a pad lane) stays in range until it is reused
            st.t.clamp_(max=self.cfg.max_new_tokens - 1)

    def _head(self, hidden: torch.Tensor, window: torch.Tensor, st: UnitState, u: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden [B, H] → codes [B]: logits, then `_sample`."""
        return self._sample(self.model.logits(hidden), window, st, u)

    def _sample(self, logits: torch.Tensor, window: torch.Tensor, st: UnitState, u: torch.Tensor) -> torch.Tensor:
        """Each row with its own session's temperature and penalty (`UnitState`), so no row affects another."""
        return tts_sample(logits, window, st.eos_blocked, u, temperature=st.temperature, penalty=st.penalty,
                          eos_id=self.model.cfg.eos_code)

    # -- graphs --------------------------------------------------------------------------------------
    def _state(self, size: int) -> UnitState:
        return UnitState.allocate(size, self.cfg.repetition_window, self.cfg.max_new_tokens, self.vocab,
                                  self.kv.scratch, self.device, self.cfg.temperature, self.cfg.repetition_penalty)

    def _capture(self, key: tuple[int, ...], fn: Callable[[], object], reset: Callable[[], object]) -> None:
        """Warm up (compiling if enabled) on all-pad rows, whose writes reach the scratch slot only.

        `reset` runs before each warm-up call but is NOT captured: the graph must not rewind `t`.
        """
        graph, _ = capture(fn, pool=self._pool, warmup=3, reset=reset)
        self._pool = graph.pool()
        self._graphs[key] = _Graph(graph, None)

    def _lanes(self) -> UnitState:
        """The continuous engine's lanes: one row per unit in flight, as many as the largest batch bucket."""
        if self._lane_state is None:
            size = self.cfg.batch_bucket(self.cfg.max_batch)
            self._lane_state = UnitState.allocate(size, self.cfg.repetition_window, self.cfg.max_new_tokens,
                                                  self.vocab, self.kv.scratch, self.device, self.cfg.temperature,
                                                  self.cfg.repetition_penalty, per_row=True)
        return self._lane_state

    def _lane_graph(self, bucket: int, kv_limit: int) -> _Graph:
        """Captured at warm-up only: a capture runs the step on the lanes, which at warm-up are all pads."""
        key = ("lanes", bucket, kv_limit)
        if key not in self._graphs:
            lanes = self._lanes()
            view = lanes.view(bucket)
            self._capture(key, lambda: self._step(view, kv_limit), lambda: lanes.t.fill_(1))
        return self._graphs[key]

    def _bucket_state(self, bucket: int) -> UnitState:
        if bucket not in self._states:
            self._states[bucket] = self._state(bucket)
        return self._states[bucket]

    def _step_graph(self, bucket: int, kv_limit: int) -> _Graph:
        key = ("step", bucket, kv_limit)
        if key not in self._graphs:
            self.misses.record("step", key, "captured now")
            st = self._bucket_state(bucket)
            st.make_padding(self.kv.scratch)
            self._capture(key, lambda: self._step(st, kv_limit), lambda: st.t.fill_(1))
        return self._graphs[key]

    def _prefill_graph(self, bucket: int, rows: int, kv_limit: int) -> _Graph:
        key = ("prefill", bucket, rows, kv_limit)
        if key not in self._graphs:
            self.misses.record("prefill", key, "captured now")
            st = self._bucket_state(bucket)
            st.make_padding(self.kv.scratch)
            cond = torch.zeros(bucket, rows, self.model.cfg.hidden_size,
                               dtype=self.model.emb_text.weight.dtype, device=self.device)
            self._capture(key, lambda: self._prefill(cond, st, kv_limit), lambda: None)
            self._graphs[key].cond = cond
        return self._graphs[key]

    def kv_buckets(self) -> tuple[int, ...]:
        """Every value `cfg.kv_bucket` can return: min_kv_bucket doubling up to max_turn_positions."""
        out = [self.cfg.kv_bucket(1)]
        while out[-1] < self.cfg.max_turn_positions:
            out.append(self.cfg.kv_bucket(out[-1] + 1))
        return tuple(out)

    @torch.inference_mode()
    def warm_up(self, emit: Callable[[str], None] | None = None) -> None:
        """Build (compile, then capture) every step and prefill graph that a batch of at most `max_batch`
        sessions can use: batch buckets x kv buckets, x row buckets for the prefill. Off CUDA there are no
        graphs: with `compile_step` the step is compiled ahead on the same buckets, otherwise a no-op."""
        top = self.cfg.batch_bucket(self.cfg.max_batch)
        batches = sorted((b for b in self.cfg.batch_buckets if b <= top), reverse=True)  # largest first: the
        kv_limits = self.kv_buckets()  # shared graph pool is sized once
        if self.use_graphs:
            progress = Progress("tts", len(batches) * len(kv_limits) * (1 + len(self.cfg.row_buckets)), emit)
            for b in batches:
                for kv_limit in kv_limits:
                    if self.cfg.continuous:
                        self._lane_graph(b, kv_limit)
                    else:
                        self._step_graph(b, kv_limit)
                    progress.step(f"step graph batch {b} kv {kv_limit}")
                    for rows in self.cfg.row_buckets:
                        self._prefill_graph(b, rows, kv_limit)
                        progress.step(f"prefill graph batch {b} rows {rows} kv {kv_limit}")
            progress.done()
        elif self.cfg.compile_step:
            progress = Progress("tts", len(batches) * len(kv_limits), emit)
            for b in batches:
                st = self._lanes().view(b) if self.cfg.continuous else self._bucket_state(b)
                st.make_padding(self.kv.scratch)  # pad rows write to the scratch slot only
                for kv_limit in kv_limits:
                    st.t.fill_(1)
                    self._step(st, kv_limit)
                    progress.step(f"compiled step batch {b} kv {kv_limit}")
            progress.done()
        self.misses.warm = True

    @torch.inference_mode()
    def capture(self, batches: tuple[int, ...], kv_limits: tuple[int, ...]) -> None:
        """Capture the step graphs ahead of traffic (no-op on CPU); prefill graphs come on first use."""
        if self.use_graphs:
            for b in batches:
                for kv_limit in kv_limits:
                    self._step_graph(self.cfg.batch_bucket(b), kv_limit)

    # -- one unit ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_unit(self, cond: torch.Tensor, n_rows: list[int], start_pos: list[int], slots: list[int],
                 eos_allowed: list[bool], u: torch.Tensor, *, use_graphs: bool | None = None,
                 temperature: list[float] | None = None, penalty: list[float] | None = None, head: int = 0,
                 on_head: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """All samples of one unit for B sessions, on the device, with no host sync.

        cond [B, T, H] condition rows on the device with `audio_bos` at row n_b (rows past it are
        padding); per-row host lists n_rows, start_pos (the turn position of row 0), slots, eos_allowed;
        u [B, S] fp64 with S = max_new_tokens; per-row temperature / penalty (default: the config's).
        Returns samples [B, S] int64; sample t is fed at
        start_pos + n + 1 + t for t < S - 1, the last one never.

        head > 0 (< S): samples 0 .. head-1 are copied out as soon as they are drawn, and `on_head` gets
        them [B, head] int64 on the host, on this thread, once that copy is done: on CUDA while the rest of
        the unit's steps, already launched, still run. The samples themselves are the same either way.
        """
        b = cond.shape[0]
        steps, w = self.cfg.max_new_tokens, self.cfg.repetition_window
        if not 0 <= head < steps:
            raise ValueError(f"run_unit: head {head} must be in [0, max_new_tokens {steps})")
        code0 = max(s + n + 1 for s, n in zip(start_pos, n_rows, strict=True))  # highest position of sample 0
        step_limit = self.cfg.kv_bucket(code0 + steps - 1)
        graphs = self.use_graphs if use_graphs is None else (use_graphs and self.use_graphs)
        step = self._step_graph(self.cfg.batch_bucket(b), step_limit) if graphs else None  # before the load: a
        st = self._prefill_rows(cond, n_rows, start_pos, slots, eos_allowed, u, graphs,  # capture pads the state
                                temperature, penalty)
        early: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        for t in range(1, steps):
            if t == head and on_head is not None:  # samples 0 .. head-1 are drawn: queue their copy before
                # the steps still to come, so the host can wait for it alone
                early = _start_copy_out(st.samples[:b, w:w + head])
            if step is not None:
                step.graph.replay()
            else:
                self._step(st, step_limit)
        if early is not None and on_head is not None:
            host, done = early  # [B, head]
            if done is not None:
                done.synchronize()  # waits for the head's copy only; the later steps keep running
            on_head(host)
        return st.samples[:b, w:].clone()

    def _prefill_rows(self, cond: torch.Tensor, n_rows: list[int], start_pos: list[int], slots: list[int],
                      eos_allowed: list[bool], u: torch.Tensor, graphs: bool, temperature: list[float] | None,
                      penalty: list[float] | None) -> UnitState:
        """Load b units (arguments as `run_unit`'s) into their batch bucket's state (a fresh one without graphs)
        and run their condition prefill, from a graph when one fits, drawing sample 0 → that state."""
        b, t_max = cond.shape[0], cond.shape[1]
        limit = self.cfg.kv_bucket(max(s + n + 1 for s, n in zip(start_pos, n_rows, strict=True)))
        bucket = self.cfg.batch_bucket(b)
        st = self._bucket_state(bucket) if graphs else self._state(b)
        rows = next((r for r in self.cfg.row_buckets if r >= t_max), None) if graphs else None
        if graphs and rows is None:
            self.misses.record("prefill_rows", t_max, "eager")
        prefill = self._prefill_graph(bucket, rows, limit) if rows is not None else None
        st.load(start=start_pos, n_rows=n_rows, slots=slots, eos_allowed=eos_allowed, u=u, scratch=self.kv.scratch,
                temperature=temperature or [self.cfg.temperature] * b,
                penalty=penalty or [self.cfg.repetition_penalty] * b)
        if prefill is not None and prefill.cond is not None:
            prefill.cond[:b, :t_max].copy_(cond)
            prefill.graph.replay()
        else:
            padded = cond if st.size == b else torch.cat([cond, cond.new_zeros(st.size - b, *cond.shape[1:])])
            self._prefill(padded, st, limit)
        return st

    # -- continuous: lanes that join and leave between single-code steps (`TTSEngineConfig.continuous`) --
    @torch.inference_mode()
    def start_lanes(self, cond: torch.Tensor, n_rows: list[int], start_pos: list[int], slots: list[int],
                    eos_allowed: list[bool], u: torch.Tensor, lanes: list[int], *, use_graphs: bool | None = None,
                    temperature: list[float] | None = None, penalty: list[float] | None = None) -> None:
        """Prefill k new units (arguments as `run_unit`'s), drawing their sample 0, and put them in `lanes`
        [k] (free ones) at t = 1; lanes already in flight are not touched. No host sync."""
        graphs = self.use_graphs if use_graphs is None else (use_graphs and self.use_graphs)
        st = self._prefill_rows(cond, n_rows, start_pos, slots, eos_allowed, u, graphs, temperature, penalty)
        self._lanes().adopt(torch.tensor(lanes, dtype=torch.int64).to(self.device, non_blocking=True), st)

    @torch.inference_mode()
    def step_lanes(self, top: int, kv_needed: int, *, use_graphs: bool | None = None) -> None:
        """One single-code step for lanes 0 .. top-1 (the batch bucket above), attending over the kv bucket
        of `kv_needed` positions. At most two such steps are queued ahead of the device: the host waits for
        the one before the last, so a unit that arrives now starts within about a step."""
        bucket = self.cfg.batch_bucket(top)
        limit = self.cfg.kv_bucket(kv_needed)
        graphs = self.use_graphs if use_graphs is None else (use_graphs and self.use_graphs)
        graph = self._graphs.get(("lanes", bucket, limit)) if graphs else None
        if graphs and graph is None:
            self.misses.record("lanes", ("lanes", bucket, limit), "eager")
        if graph is not None:
            graph.graph.replay()
        else:
            self._step(self._lanes().view(bucket), limit)
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self._in_flight.append(done)
            if len(self._in_flight) > 2:
                self._in_flight.pop(0).synchronize()

    @torch.inference_mode()
    def release_lanes(self, lanes: list[int]) -> None:
        """Lanes whose unit ended (its samples copied out first) or was aborted become pad rows."""
        self._lanes().release(torch.tensor(lanes, dtype=torch.int64).to(self.device, non_blocking=True),
                              self.kv.scratch)

    def copy_lane(self, lane: int, count: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of a lane's samples 0 .. count-1 to the host: (host tensor [count], the event to
        wait on before reading it; None off CUDA)."""
        w = self.cfg.repetition_window
        return _start_copy_out(self._lanes().samples[lane, w:w + count])


def _start_copy_out(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue a device → host copy of `t` now: (host tensor, the event to wait on before reading it; None
    off CUDA, where the copy is done on return)."""
    if t.device.type != "cuda":
        return t.clone(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done
