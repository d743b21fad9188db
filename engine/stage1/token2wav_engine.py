"""Token2Wav engine: codes → 24 kHz PCM16 chunks per session and turn, batched across sessions.

One owner thread calls `submit` / `cancel` / `step`. A unit is planned at submit time (§6.4: silence
prefix, 25 + 3 codes per call, flush rules, last-chunk flush at turn end); `step` runs at most one
call per session: collect → one ragged flow batch (any mix of code counts, `last` flags and prompt
/ cache lengths; caches live in a slot-indexed pool, pool.py) → HiFT batches per mel length → finish
→ emit. Chunks are emitted as soon as their call finishes; the §6.6 left pad of a short unit goes out
first. A unit may come in two parts: a head (its first codes, sent early so that a turn's first audio is
rendered while the TTS still makes the rest) and the rest (stream.py `plan_head` / `plan_rest`). Per-voice
base caches are built once and copied into the session's slot per turn (§6.8).
`ragged=False` keeps the exact-shape buckets with per-session cache tensors (and the DiT graphs).
`warm_up` builds the graphs at load by running synthetic turns through the engine itself. With graphs
the flow batch and each HiFT batch run at a row bucket (buckets.py: 1 2 4 8 16 24 32 48 64 …, padded
with dummy rows whose results are dropped), so warm-up runs the buckets only, not every batch size; a
later shape without a graph is a `misses` entry (counted, logged once).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.stage1.types import Fence
from engine.token2wav.assets import Token2WavModels
from engine.token2wav.batch import flow_bucket_key, group_by, hift_bucket_key
from engine.token2wav.buckets import bucket_rows, row_buckets
from engine.token2wav.config import StreamConfig
from engine.token2wav.errors import (  # noqa: F401 - re-exported: the engine's public error types
    CapacityError,
    CodeRangeError,
    SessionExistsError,
    StaleFenceError,
    Token2WavError,
    UnitPartError,
    UnknownSessionError,
    UnknownVoiceError,
)
from engine.token2wav.graphs import GraphCache
from engine.token2wav.hift import draw_nsf
from engine.token2wav.pool import FlowPool, PoolConfig, PoolError
from engine.token2wav.pooled import run_flow_pooled
from engine.token2wav.ragged_graphs import MEL_INPUT, TOK_INPUT, RaggedSolver
from engine.token2wav.stream import PendingCall, SessionStream, StreamInputError, new_session, run_flow_batch
from engine.token2wav.voice import VoiceCache, build_voice_cache
from engine.warmup import GraphMisses, Progress

WARMUP_SESSION = "__warmup_{}"
PARTS = (None, "head", "rest")  # a whole unit, or its two parts
WARMUP_UNITS = 4  # a turn of 4 units: first call, calls while the kept cache grows, steady call, last call
# Turns per batch size, at most: turns repeat until one builds no new graph (with the pooled path's fixed widths,
# pooled.py, the second turn builds none; the exact-shape path's shapes follow each session's history).
WARMUP_TURNS = 8


@dataclass(frozen=True)
class Token2WavEngineConfig:
    stream: StreamConfig = StreamConfig()   # n_timesteps (default 5), trims, flush rule, first_hop
    max_batch: int = 32                     # sessions per flow / HiFT batch
    use_cuda_graphs: bool = True            # estimator + vocoder graphs at exact shapes (GPU only)
    max_graphs: int = 32
    ragged: bool = True                     # one flow batch for ragged rows over the slot pool
    ragged_graphs: bool = True              # CUDA graphs of the ragged encoder and estimator solve
    pool: PoolConfig = PoolConfig()         # slots (max open sessions), prompt cap, bucket sizes
    # the TTS's `first_codes` (0: none): a turn's first unit then comes as a head of this many codes and a rest, and
    # warm-up turns alternate between that and whole units, so the head's and rest's call shapes are built too
    # (served without them, every batch of heads ran its vocoder eagerly: bench/RESULTS.md, stop 33)
    head_codes: int = 0
    # the TTS's `head_every_unit`: every unit may come as a head and a rest, and a head renders at once in any unit
    # of a turn (not only in its first), so warm-up sends every unit of its turns in two parts
    head_every_unit: bool = False
    # the flow's conformer and DiT blocks torch.compile'd (`Flow.compile_blocks`, regional: one block compiled for
    # all blocks of a kind) before its graphs are captured: fewer, fused kernels in the encoder and in each of the 5
    # Euler steps. Mel close to, not equal with, eager
    compile_flow: bool = False
    # the HiFT's Snake activations torch.compile'd (`HiFT.compile_snakes`): five elementwise kernels each fuse into one
    compile_hift: bool = False
    # batch invariance (model.md I9: a session's PCM the same bits alone and among others). The convolutions'
    # kernels follow the batch's row count (cuDNN's algorithm on the H200, and oneDNN's on a CPU: a session's
    # flow mel 1 float16 step apart among n, 1 LSB of PCM; bench/RESULTS.md stop 39). `tile_rows` K runs every
    # flow and HiFT batch on exactly K rows (fewer padded with dummy rows, more in chunks of K) at the widest
    # token width, so no company changes a kernel's shape. 0: each batch at its row bucket (the widths too)
    tile_rows: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tile_rows <= self.max_batch:
            raise ValueError(f"Token2WavEngineConfig.tile_rows: must be 0..max_batch ({self.max_batch}), "
                             f"got {self.tile_rows}")
        if self.head_every_unit and not (self.head_codes and self.stream.force_flush == "always"):
            raise ValueError("Token2WavEngineConfig.head_every_unit needs head_codes > 0 and the stream's "
                             "force_flush 'always' (a rest of fewer than 28 codes then still makes its call)")
        if self.tile_rows and not self.ragged:
            raise ValueError("Token2WavEngineConfig.tile_rows needs the pooled flow (ragged=True)")


@dataclass(frozen=True, kw_only=True)  # keywords: `unit_final` and `end_of_turn` are two flags side by side
class PcmChunk:
    """24 kHz mono PCM16 of one session; `unit_final` marks the unit's last chunk, `part_final` the last chunk
    of its submit (a head's last chunk is part_final, not unit_final; otherwise the two are equal)."""

    session_id: str
    fence: Fence
    unit_index: int
    pcm: np.ndarray            # int16 [n]
    unit_final: bool
    part_final: bool
    end_of_turn: bool


@dataclass(frozen=True)
class Token2WavCancelResult:
    session_id: str
    fence: Fence
    dropped_units: tuple[int, ...]
    noop: bool


@dataclass
class _Item:
    unit_index: int
    fence: Fence
    end_of_turn: bool
    unit_final: bool
    call: PendingCall | None = None   # None: emit `zeros` samples of silence (pad or listen unit)
    zeros: int = 0
    reset_after: bool = False         # end of turn: reset the execution state after this item
    part_final: bool = False          # the last item of its submit


@dataclass
class _Session:
    stream: SessionStream
    fence: Fence
    queue: deque[_Item] = field(default_factory=deque)
    head_unit: int | None = None      # the unit whose head waits for its rest


class Token2WavEngine:
    def __init__(self, models: Token2WavModels, cfg: Token2WavEngineConfig | None = None) -> None:
        self.models, self.cfg = models, cfg or Token2WavEngineConfig()
        if self.cfg.compile_flow:
            models.flow.compile_blocks()  # the caller's model: its blocks now run compiled
        if self.cfg.compile_hift:
            models.hift.compile_snakes()
        self.graphs = GraphCache(models.flow.decoder.estimator, models.hift, self.cfg.use_cuda_graphs,
                                 self.cfg.max_graphs, encoder=models.flow.encoder)
        dtype = next(models.flow.parameters()).dtype
        device = models.flow.spk_embed_affine_layer.weight.device
        self.pool = (FlowPool(models.flow_cfg, self.cfg.stream, self.cfg.pool, device, dtype)
                     if self.cfg.ragged else None)
        self.buckets = (self.cfg.tile_rows,) if self.cfg.tile_rows else row_buckets(self.cfg.max_batch)
        self.solver = RaggedSolver(models.flow.decoder.estimator, self.cfg.use_cuda_graphs and self.cfg.ragged_graphs,
                                   self.cfg.max_graphs, self.buckets)
        self.voices: dict[str, VoiceCache] = {}
        self.sessions: dict[str, _Session] = {}
        self.misses = GraphMisses("token2wav")
        self.graphs.misses = self.solver.misses = self.misses

    # -- warm-up ------------------------------------------------------------------------------------
    def warm_up(self, voice_id: str, emit: Callable[[str], None] | None = None, warm_batch: int | None = None,
                seed: int = 0) -> None:
        """Build the graphs of every row bucket up to the one of `warm_batch` (default max_batch): per
        bucket, that many sessions speak `WARMUP_UNITS`-unit turns of random codes in lock step, until a
        turn builds no new graph (at most `WARMUP_TURNS`). Without graphs but with compiled blocks
        (`compile_flow` / `compile_hift`, e.g. on a CPU) two turns per bucket, with and without heads, so
        that dynamo compiles here and not on the first sessions' audio. No-op otherwise."""
        graphs = self.graphs.enabled or self.solver.enabled
        if graphs or self.cfg.compile_flow or self.cfg.compile_hift:
            top = bucket_rows(min(warm_batch or self.cfg.max_batch, self.cfg.max_batch), self.buckets)
            sizes = self.warm_sizes(top)
            progress = Progress("token2wav", len(sizes) + int(self.graphs.enabled), emit)
            if self.pool is not None and self.solver.enabled:
                self._reserve(sizes[0])
            rng = np.random.default_rng(seed)
            for b in sizes:  # largest first: the shared pool and the static buffers are sized once
                turns, grew = 0, True
                while grew and turns < WARMUP_TURNS:
                    before = self.graph_count()
                    self._warm_turn(voice_id, b, rng, heads=turns % 2 == 0 and self.cfg.head_codes > 0)
                    turns += 1
                    grew = self.graph_count() > before if graphs else turns < 2
                progress.step(f"batch {b}: {turns} turns, {self.graph_count()} graphs")
            if self.graphs.enabled:
                progress.step(f"vocoder: {self._warm_vocoder_lengths()} more call lengths")
            progress.done()
        self.misses.warm = True

    def _warm_vocoder_lengths(self) -> int:
        """HiFT graphs for every length a turn's first or last call can have (1..chunk_call codes, without and
        with the kept mel), at 1 and 2 rows, on top of `max_graphs`. A served TTS unit may end a turn, or
        start one, with any number of codes; uniform warm-up turns never make those lengths, and on the H200
        each one was captured on live traffic, stalling every session's audio (stop 26). With `tile_rows`, at
        that many rows."""
        s, up = self.cfg.stream, self.models.flow_cfg.up_stride
        hcfg, dev = self.models.hift_cfg, next(self.models.hift.parameters()).device
        n_over = s.mel_cache_frames * hcfg.samples_per_frame
        gen = torch.Generator(device=dev).manual_seed(0)
        rows = (self.cfg.tile_rows,) if self.cfg.tile_rows else (1, 2)
        shapes = [(r, kept, kept + up * k) for r in rows if r in self.buckets
                  for kept in (0, s.mel_cache_frames) for k in range(1, s.chunk_call + 1)]
        before = len(self.graphs.hift_graphs)
        self.graphs.max_graphs += len(shapes)
        with torch.inference_mode():
            for r, kept, frames in shapes:
                ini, noise = draw_nsf(gen, frames, hcfg, dev)
                self.graphs.vocoder(torch.zeros(r, self.models.flow_cfg.mel_dim, frames, device=dev),
                                    torch.zeros(r, 1, n_over if kept else 0, device=dev),
                                    ini.repeat(r, 1), noise.repeat(r, 1, 1))
        return len(self.graphs.hift_graphs) - before

    def warm_sizes(self, top: int | None = None) -> tuple[int, ...]:
        """The batch sizes warm-up runs, largest first: the row buckets up to `top` (default max_batch);
        every size on the exact-shape path (`ragged=False`), whose flow batches are not padded."""
        top = top or self.cfg.max_batch
        return tuple(b for b in reversed(self.buckets) if b <= top) if self.pool is not None else tuple(range(top, 0, -1))

    def _reserve(self, rows: int) -> None:
        """The solver's shared conformer-history inputs at their largest first (a later growth would leave
        the graphs captured before it their own copy)."""
        assert self.pool is not None
        p = self.pool
        for position, cache, width in ((TOK_INPUT, p.tok_att, p.tok_width), (MEL_INPUT, p.mel_att, p.mel_width)):
            _, layers, heads, _, dk2 = cache.shape   # [S, L, H, T, 2dk]
            self.solver.reserve("encode", position, layers * rows * heads * width * dk2, cache)

    def _warm_turn(self, voice_id: str, b: int, rng: np.random.Generator, heads: bool = False) -> None:
        """`b` sessions speak one turn in lock step; with `heads` each turn's first unit comes as a head of
        `head_codes` codes and a rest (every unit, with `head_every_unit`), as the TTS sends it with `first_codes`."""
        fence, vocab = Fence(0, 0), self.models.flow_cfg.vocab_size
        sids = [WARMUP_SESSION.format(i) for i in range(b)]
        for i, sid in enumerate(sids):
            self.open(sid, fence, voice_id, seed=i)
        try:
            for unit in range(WARMUP_UNITS):
                for sid in sids:
                    codes = rng.integers(0, vocab, self.cfg.stream.chunk_new).tolist()
                    end, k = unit == WARMUP_UNITS - 1, self.cfg.head_codes
                    if heads and (unit == 0 or self.cfg.head_every_unit) and 0 < k < len(codes):
                        self.submit(sid, fence, unit, codes[:k], False, part="head", unit_codes=len(codes))
                        self.submit(sid, fence, unit, codes[k:], end, part="rest")
                    else:
                        self.submit(sid, fence, unit, codes, end_of_turn=end)
            while self.pending():
                self.step()
        finally:
            for sid in sids:
                self.close(sid, fence)

    def graph_count(self) -> int:
        g, r = self.graphs, self.solver
        return len(g.dit_graphs) + len(g.hift_graphs) + len(g.enc_graphs) + len(r.graphs) + len(r.enc_graphs)

    # -- voices and sessions ------------------------------------------------------------------------
    def add_voice(self, voice_id: str, pack: Any) -> VoiceCache:
        """Build the voice's immutable base cache once (§6.2); later calls reuse it."""
        if voice_id not in self.voices:
            voice = build_voice_cache(self.models.flow, pack, self.cfg.stream)
            if self.pool is not None:
                try:
                    self.pool.check_voice(voice)
                except PoolError as exc:
                    raise CapacityError(str(exc)) from None
            self.voices[voice_id] = voice
        return self.voices[voice_id]

    def open(self, session_id: str, fence: Fence, voice_id: str, seed: int) -> None:
        if session_id in self.sessions:
            raise SessionExistsError(f"session {session_id!r} is already open")
        if voice_id not in self.voices:
            raise UnknownVoiceError(f"voice {voice_id!r} was never added")
        slot = None
        if self.pool is not None:
            try:
                slot = self.pool.acquire()
            except PoolError as exc:
                raise CapacityError(str(exc)) from None
        try:
            stream = new_session(self.models, self.voices[voice_id], self.cfg.stream, seed, slot)
        except Exception:
            if slot is not None:
                self.pool.release(slot)   # type: ignore[union-attr]
            raise
        self.sessions[session_id] = _Session(stream, fence)

    def close(self, session_id: str, fence: Fence) -> bool:
        s = self.sessions.get(session_id)
        if s is None or s.fence.incarnation != fence.incarnation:
            return False
        del self.sessions[session_id]
        if self.pool is not None and s.stream.slot is not None:
            self.pool.release(s.stream.slot)
        return True

    def _session(self, session_id: str, fence: Fence) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise UnknownSessionError(f"no open Token2Wav session {session_id!r}")
        if fence.incarnation != s.fence.incarnation or fence.epoch < s.fence.epoch:
            raise StaleFenceError(f"session {session_id!r}: fence {fence} is stale (current {s.fence})")
        return s

    # -- inputs -------------------------------------------------------------------------------------
    def submit(self, session_id: str, fence: Fence, unit_index: int, codes: Sequence[int], end_of_turn: bool,
               part: str | None = None, unit_codes: int | None = None) -> int:
        """Queue one speak unit's codes, or one part of it: `part="head"`, its first codes (`unit_codes`: the
        codes the whole unit has, for its pad), then `part="rest"`. A rest without its head is a whole unit.
        Returns the samples this submit will emit (pads included)."""
        s = self._session(session_id, fence)
        head_unit = s.head_unit if fence.epoch == s.fence.epoch else None   # a newer epoch drops the head
        self._check_part(part, unit_index, end_of_turn, head_unit)
        try:
            s.stream.check_codes(codes)
        except StreamInputError as exc:
            raise CodeRangeError(str(exc)) from None
        if fence.epoch > s.fence.epoch:       # a newer epoch implies the older one was cancelled
            self._drop_older(s, fence)
        if part == "head":
            plan, s.head_unit = s.stream.plan_head(codes, unit_codes, self.cfg.head_every_unit), unit_index
        elif head_unit is not None:
            plan, s.head_unit = s.stream.plan_rest(codes, end_of_turn), None
        else:
            plan = s.stream.plan_unit(codes, end_of_turn)
        items = [_Item(unit_index, fence, end_of_turn, False, call=c) for c in plan.calls]
        if plan.pad:
            pad = _Item(unit_index, fence, end_of_turn, False, zeros=plan.pad)
            items = [*items, pad] if plan.pad_after else [pad, *items]
        if not items:                          # nothing to emit (end of turn, a head only buffered): mark the end
            items = [_Item(unit_index, fence, end_of_turn, False)]
        items[-1].unit_final = part != "head"
        items[-1].part_final = True
        items[-1].reset_after = end_of_turn
        s.queue.extend(items)
        return plan.samples + plan.pad

    @staticmethod
    def _check_part(part: str | None, unit_index: int, end_of_turn: bool, head_unit: int | None) -> None:
        if part not in PARTS:
            raise UnitPartError(f"part {part!r} is not one of {PARTS[1:]}")
        if part == "head" and end_of_turn:
            raise UnitPartError("a head cannot end a turn: its rest does")
        if head_unit is not None and (part != "rest" or unit_index != head_unit):
            raise UnitPartError(f"unit {head_unit}'s head waits for its rest; got {part or 'a whole unit'} "
                                f"of unit {unit_index}")

    def submit_listen(self, session_id: str, fence: Fence, unit_index: int) -> None:
        """A listen unit: 1 s of zeros (§6.6), in order with the session's other output."""
        s = self._session(session_id, fence)
        s.queue.append(_Item(unit_index, fence, False, True, zeros=self.cfg.stream.unit_samples, part_final=True))

    def cancel(self, session_id: str, fence: Fence, next_fence: Fence) -> Token2WavCancelResult:
        """Adopt `next_fence` (epoch + 1 only; a late cancel is a no-op) and drop this session's queued
        work of older epochs (F-1…F-3). Its Token2Wav turn restarts; the TTS keeps its own turn (Q13)."""
        s = self.sessions.get(session_id)
        if s is None:
            raise UnknownSessionError(f"no open Token2Wav session {session_id!r}")
        if next_fence.incarnation != fence.incarnation or next_fence.epoch != fence.epoch + 1:
            raise StaleFenceError(f"cancel of {session_id!r}: next_fence {next_fence} must be epoch + 1")
        if fence.incarnation != s.fence.incarnation:
            raise StaleFenceError(f"cancel of {session_id!r}: incarnation {fence.incarnation} is not live")
        if s.fence.epoch > fence.epoch:
            return Token2WavCancelResult(session_id, fence, (), noop=True)
        return Token2WavCancelResult(session_id, fence, self._drop_older(s, next_fence), noop=False)

    def _drop_older(self, s: _Session, fence: Fence) -> tuple[int, ...]:
        s.fence, s.head_unit = fence, None
        dropped = tuple(sorted({i.unit_index for i in s.queue if i.fence.epoch < fence.epoch}))
        s.queue = deque(i for i in s.queue if i.fence.epoch >= fence.epoch)
        s.stream.reset_turn()
        return dropped

    def pending(self) -> int:
        return sum(len(s.queue) for s in self.sessions.values())

    # -- the step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[PcmChunk]:
        out: list[PcmChunk] = []
        work: list[tuple[str, _Session, _Item]] = []
        for sid, s in self.sessions.items():
            self._drain_silence(sid, s, out)
            if s.queue and len(work) < self.cfg.max_batch:
                work.append((sid, s, s.queue[0]))
        if not work:
            return out
        self._run_flow(work)
        self._run_hift(work, out)
        for sid, s, _ in work:
            s.queue.popleft()
            self._drain_silence(sid, s, out)
        return out

    def _drain_silence(self, sid: str, s: _Session, out: list[PcmChunk]) -> None:
        while s.queue and s.queue[0].call is None:
            item = s.queue.popleft()
            if item.zeros or item.part_final:
                out.append(PcmChunk(session_id=sid, fence=item.fence, unit_index=item.unit_index,
                                    pcm=np.zeros(item.zeros, np.int16), unit_final=item.unit_final,
                                    part_final=item.part_final, end_of_turn=item.end_of_turn))
            if item.reset_after:
                s.stream.reset_exec()

    def _run_flow(self, work: list[tuple[str, _Session, _Item]]) -> None:
        if self.pool is not None:
            flows = [(s.stream, i.call) for _, s, i in work if i.call is not None]
            tile = self.cfg.tile_rows or len(flows)
            for at in range(0, len(flows), max(tile, 1)):
                chunk = flows[at:at + tile]
                run_flow_pooled(self.models, self.pool, [f[0] for f in chunk], [f[1] for f in chunk], self.solver,
                                tile=self.cfg.tile_rows)
            return
        n_ts = self.cfg.stream.n_timesteps
        keys = [flow_bucket_key(s.stream.flow_cache, len(i.call.tokens), i.call.last, n_ts)
                for _, s, i in work if i.call is not None]
        for group in group_by(keys):
            sessions = [work[g][1].stream for g in group]
            calls = [work[g][2].call for g in group]
            run_flow_batch(self.models, sessions, calls, self.graphs.estimator,  # type: ignore[arg-type]
                           self.graphs.encoder)

    def _run_hift(self, work: list[tuple[str, _Session, _Item]], out: list[PcmChunk]) -> None:
        inputs = [s.stream.hift_inputs(i.call) for _, s, i in work if i.call is not None]
        keys = [hift_bucket_key(x[0].shape[2], x[1].shape[2]) for x in inputs]
        tile = self.cfg.tile_rows
        groups = group_by(keys)
        for group in [g[i:i + tile] for g in groups for i in range(0, len(g), tile)] if tile else groups:
            pad = self._hift_rows(len(group)) - len(group)
            mel, src, ini, noise = (torch.cat([inputs[g][k] for g in group] + [inputs[group[0]][k].new_zeros(
                pad, *inputs[group[0]][k].shape[1:])], dim=0) for k in range(4))   # + dummy rows: zeros, dropped
            speech, source = self.graphs.vocoder(mel, src, ini, noise)
            for row, g in enumerate(group):
                sid, s, item = work[g]
                assert item.call is not None
                pcm = s.stream.finish_phase(item.call, inputs[g][0], speech[row:row + 1], source[row:row + 1])
                out.append(PcmChunk(session_id=sid, fence=item.fence, unit_index=item.unit_index, pcm=pcm,
                                    unit_final=item.unit_final, part_final=item.part_final,
                                    end_of_turn=item.end_of_turn))
                if item.reset_after:
                    s.stream.reset_exec()

    def _hift_rows(self, n: int) -> int:
        """The rows a HiFT batch of n runs on: the tile, the row bucket (graphs), or n itself (eager)."""
        if self.cfg.tile_rows:
            return self.cfg.tile_rows
        return bucket_rows(n, self.buckets) if self.graphs.enabled else n
