"""Stage1 TTS engine: per-session speaking units in, codes out, batched across sessions.

Owner: one engine thread calls every method (other threads post messages to it). A `step()` reads top
to bottom: collect (one queued unit per session) → prepare (condition rows, per-row uniforms) → run
(one prefill + single-code steps for the whole batch, `TTSRunner`) → postprocess (trim at EOS, commit
draws, advance or reset the turn) → emit (results whose fence is still live).

With `first_codes` = K > 0 and an `on_head` callback, a unit that starts a TTS turn (every unit, with
`head_every_unit`) also sends its first K codes (`TTSHeadCodes`) during the run, as soon as they are sampled,
unless one of them is EOS; its result then says so (`TTSUnitResult.head`).

With `continuous`, a `step()` is one single-code step of every unit in flight (a lane each): queued units of
sessions with nothing in flight first prefill into free lanes, a unit leaves when its last sample is drawn,
and its samples (and a head) come back through copies that the next steps collect once done. A session has
at most one unit in flight, since its next unit starts where this one's codes end.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.hostio import to_device
from engine.model.tts import TTSModel
from engine.stage1.config import TTSEngineConfig
from engine.stage1.runner import TTSRunner
from engine.stage1.sessions import SlotTable, TTSSession
from engine.stage1.types import (
    BadSamplingError,
    Fence,
    HiddenDimError,
    RowCountError,
    SessionExistsError,
    StaleFenceError,
    TokenIdError,
    TTSCancelResult,
    TTSHeadCodes,
    TTSUnitRequest,
    TTSUnitResult,
    TurnCapacityError,
    UnknownSessionError,
)

log = logging.getLogger(__name__)


@dataclass
class _Work:
    session: TTSSession
    req: TTSUnitRequest
    rng_state: torch.Tensor
    u: torch.Tensor  # [S] fp64
    start_pos: int
    eos_allowed: bool


@dataclass
class _Flight:
    """A unit in a lane (continuous engine): `t` = the sample its lane's next step draws."""

    work: _Work
    lane: int
    t: int
    kv_end: int  # positions its last step needs
    head_queued: bool = False  # the copy of its first codes is queued
    head: bool = False  # they went out as a head


@dataclass
class _Copy:
    """Samples on their way to the host: a head (sent as `TTSHeadCodes`) or a finished unit."""

    flight: _Flight
    host: torch.Tensor
    done: torch.cuda.Event | None
    is_head: bool


class TTSEngine:
    def __init__(self, model: TTSModel, cfg: TTSEngineConfig | None = None) -> None:
        self.model, self.cfg = model.eval(), cfg or TTSEngineConfig()
        if self.cfg.fuse_projections and not model.fused:
            model.fuse_projections()  # same parameters (views), so the caller's model is unchanged in value
        model.tile_gemm_rows(self.cfg.gemm_tile_rows)
        self.mcfg = model.cfg
        self.runner = TTSRunner(model, self.cfg, dtype=model.emb_text.weight.dtype)
        self.slots = SlotTable(self.cfg.max_sessions)
        self.sessions: dict[str, TTSSession] = {}
        self._order: list[str] = []  # sessions in first-come order, for fair batch selection
        self._flights: list[_Flight] = []  # continuous: units in lanes
        self._copies: deque[_Copy] = deque()  # continuous: copies out, in the order they were queued
        self.rows_last_step = 0  # rows the last step served
        self.units_finished = 0  # units that left the engine after running, with a result or fenced off

    # -- session lifecycle ------------------------------------------------------------------------
    def open(self, session_id: str, fence: Fence, seed: int, *, temperature: float | None = None,
             repetition_penalty: float | None = None) -> None:
        """`temperature` / `repetition_penalty`: this session's talker sampling (default: the config's)."""
        if session_id in self.sessions:
            raise SessionExistsError(f"session {session_id!r} is already open")
        t, p = self._sampling(temperature, repetition_penalty)
        slot = self.slots.acquire()
        self.sessions[session_id] = TTSSession.open(session_id, slot, fence, seed, temperature=t,
                                                    repetition_penalty=p)

    def set_sampling(self, session_id: str, *, temperature: float | None = None,
                     repetition_penalty: float | None = None) -> None:
        """New talker sampling for the session's units that have not started (None keeps a value)."""
        s = self._session(session_id)
        s.temperature, s.repetition_penalty = self._sampling(temperature if temperature is not None else s.temperature,
                                                             repetition_penalty if repetition_penalty is not None
                                                             else s.repetition_penalty)

    def _sampling(self, temperature: float | None, penalty: float | None) -> tuple[float, float]:
        t = self.cfg.temperature if temperature is None else float(temperature)
        p = self.cfg.repetition_penalty if penalty is None else float(penalty)
        if not (math.isfinite(t) and t > 0 and math.isfinite(p) and p > 0):
            raise BadSamplingError(f"talker temperature {t} and repetition penalty {p} must be finite and > 0")
        return t, p

    def close(self, session_id: str, fence: Fence) -> bool:
        """Release the session's slot; a close with another incarnation is a no-op (returns False)."""
        s = self.sessions.get(session_id)
        if s is None or s.fence.incarnation != fence.incarnation:
            return False
        del self.sessions[session_id]
        self._abort(s)
        self.slots.release(s.slot)
        return True

    def _abort(self, s: TTSSession) -> None:
        """Continuous: take the session's unit out of its lane before the slot can go to another session
        (the lane's later steps would write that slot's KV), and forget its copies."""
        mine = [f for f in self._flights if f.work.session is s]
        if mine:
            self.runner.release_lanes([f.lane for f in mine])
            self._flights = [f for f in self._flights if f.work.session is not s]
        self._copies = deque(c for c in self._copies if c.flight.work.session is not s)

    def _session(self, session_id: str) -> TTSSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"no open TTS session {session_id!r}") from None

    # -- inputs ------------------------------------------------------------------------------------
    def submit(self, req: TTSUnitRequest) -> None:
        """Validate and queue one unit. Any error is raised before a single piece of state changes."""
        s = self._session(req.session_id)
        self._check_fence(s, req.fence)
        self._check_rows(req)
        end = s.projected_end(req.n_rows, self.cfg.max_new_tokens)
        if end > self.cfg.max_turn_positions:
            # A turn longer than the cap (the model did not end it, or an override closed it without
            # resetting the TTS, Q13) goes on in a fresh TTS context: refusing would wedge the session.
            req = dataclasses.replace(req, restart=True)
            end = s.projected_end(req.n_rows, self.cfg.max_new_tokens, restart=True)
        if end > self.cfg.max_turn_positions:
            raise TurnCapacityError(f"unit {req.unit_index} of {req.session_id!r} would reach turn position "
                                    f"{end} > max_turn_positions {self.cfg.max_turn_positions}")
        if req.fence.epoch > s.fence.epoch:  # a newer epoch implies the older one was cancelled
            self._drop_older(s, req.fence)
        s.queue.append(req)
        if req.session_id not in self._order:
            self._order.append(req.session_id)

    def _check_fence(self, s: TTSSession, fence: Fence) -> None:
        if fence.incarnation != s.fence.incarnation or fence.epoch < s.fence.epoch:
            raise StaleFenceError(f"session {s.session_id!r}: fence {fence} is stale (current {s.fence})")

    def _check_rows(self, req: TTSUnitRequest) -> None:
        h, n = req.hidden, req.n_rows
        if not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.dim() != 2:
            raise HiddenDimError("hidden must be a float tensor [n, llm_dim]")
        if h.shape[1] != self.mcfg.llm_dim:
            raise HiddenDimError(f"hidden dim {h.shape[1]} != llm_dim {self.mcfg.llm_dim}")
        if h.shape[0] != n or len(req.is_turn_eos) != n:
            raise RowCountError(f"rows disagree: {n} text ids, {h.shape[0]} hidden rows, "
                                f"{len(req.is_turn_eos)} is_turn_eos flags")
        bad = [t for t in req.text_ids if not 0 <= t < self.mcfg.num_text_tokens]
        if bad:
            raise TokenIdError(f"text ids {bad[:4]} outside [0, {self.mcfg.num_text_tokens})")

    def cancel(self, session_id: str, fence: Fence, next_fence: Fence) -> TTSCancelResult:
        """Adopt `next_fence` and drop this session's queued units of older epochs (protocol.md F-1…F-3).

        The TTS turn state (KV, tts_pos) is kept: a barge-in closes the turn through Stage0 (Q13).
        """
        s = self._session(session_id)
        if next_fence.incarnation != fence.incarnation or next_fence.epoch != fence.epoch + 1:
            raise StaleFenceError(f"cancel of {session_id!r}: next_fence {next_fence} must be epoch + 1")
        if fence.incarnation != s.fence.incarnation:
            raise StaleFenceError(f"cancel of {session_id!r}: incarnation {fence.incarnation} is not live")
        if s.fence.epoch > fence.epoch:  # F-2: a late cancel never moves the session backward
            return TTSCancelResult(session_id, fence, (), noop=True)
        dropped = self._drop_older(s, next_fence)
        return TTSCancelResult(session_id, fence, dropped, noop=False)

    def _drop_older(self, s: TTSSession, fence: Fence) -> tuple[int, ...]:
        s.fence = fence
        dropped = tuple(r.unit_index for r in s.queue if r.fence.epoch < fence.epoch)
        kept = [r for r in s.queue if r.fence.epoch >= fence.epoch]
        s.queue.clear()
        s.queue.extend(kept)
        return dropped

    # -- the engine step -----------------------------------------------------------------------------
    def pending(self) -> int:
        """Units queued, in flight or with their codes still on the way (continuous)."""
        return sum(len(s.queue) for s in self.sessions.values()) + len(self._flights) + \
            sum(not c.is_head for c in self._copies)

    def holds(self, session_id: str) -> set[int]:
        """`id()` of the session's units that may still give a result: queued, in flight, on the way."""
        s = self.sessions.get(session_id)
        if s is None:
            return set()
        units = [*s.queue, *(f.work.req for f in self._flights if f.work.session is s),
                 *(c.flight.work.req for c in self._copies if c.flight.work.session is s and not c.is_head)]
        return {id(u) for u in units}

    def step(self, *, use_graphs: bool | None = None,
             on_head: Callable[[list[TTSHeadCodes]], None] | None = None) -> list[TTSUnitResult]:
        """One batch of units (continuous: one single-code step). `on_head` (with `first_codes` > 0) gets the
        turn-start units' first codes during the run, on this thread, before this returns their results."""
        if self.cfg.continuous:
            return self._step_lanes(use_graphs, on_head)
        work = self._collect()
        self.rows_last_step = len(work)
        if not work:
            return []
        cond = self._condition_rows(work)
        u = torch.stack([w.u for w in work])  # [B, S]
        heads: dict[int, TTSHeadCodes] = {}  # batch row -> the head sent for it
        send = None
        if on_head is not None and self.cfg.first_codes > 0 and any(self._sends_head(w) for w in work):
            send = functools.partial(self._send_heads, work, heads, on_head)
        samples = self.runner.run_unit(
            cond, [w.req.n_rows for w in work], [w.start_pos for w in work],
            [w.session.slot for w in work], [w.eos_allowed for w in work], u, use_graphs=use_graphs,
            temperature=[w.session.temperature for w in work], penalty=[w.session.repetition_penalty for w in work],
            head=self.cfg.first_codes if send is not None else 0, on_head=send)
        sent = [len(heads[b].codes) if b in heads else 0 for b in range(len(work))]
        return self._postprocess(work, samples.cpu().tolist(), sent)  # the step's one host sync (but a head's)

    def _collect(self, room: int | None = None, busy: set[str] = frozenset()) -> list[_Work]:
        """One queued unit from each of up to `room` (default max_batch) sessions not in `busy`."""
        work: list[_Work] = []
        self._order = [sid for sid in self._order if sid in self.sessions and self.sessions[sid].queue]
        ready = [sid for sid in self._order if sid not in busy][: self.cfg.max_batch if room is None else room]
        for sid in ready:
            s = self.sessions[sid]
            req = s.queue.popleft()
            if (req.restart or self.cfg.turn_start_resets_kv and req.turn_start) and s.tts_pos > 0:
                s.tts_pos = 0
            state, u = s.take_uniforms(self.cfg.max_new_tokens)
            # §5.3: EOS may end the unit at turn start (tts_pos == 0, the TTS's own state) or turn end
            work.append(_Work(s, req, state, u, s.tts_pos, s.tts_pos == 0 or req.end_of_turn))
        # round-robin: the sessions served now go to the back
        self._order = [sid for sid in self._order if sid not in ready] + ready
        return work

    # -- the continuous step --------------------------------------------------------------------------
    def _step_lanes(self, use_graphs: bool | None,
                    on_head: Callable[[list[TTSHeadCodes]], None] | None) -> list[TTSUnitResult]:
        out = self._collect_copies(on_head, wait=False)
        busy = {f.work.session.session_id for f in self._flights} | \
            {c.flight.work.session.session_id for c in self._copies if not c.is_head}
        work = self._collect(self.cfg.max_batch - len(self._flights), busy)
        if work:
            self._start(work, use_graphs)
        steps, head = self.cfg.max_new_tokens, self.cfg.first_codes if on_head is not None else 0
        self.rows_last_step = len(self._flights)
        if self._flights:
            self.runner.step_lanes(max(f.lane for f in self._flights) + 1, max(f.kv_end for f in self._flights),
                                   use_graphs=use_graphs)
            for f in self._flights:
                f.t += 1
        for f in self._flights:
            if head and f.t >= head and self._sends_head(f.work) and not f.head_queued:  # samples 0 .. head-1 drawn
                f.head_queued = True
                self._copies.append(_Copy(f, *self.runner.copy_lane(f.lane, head), is_head=True))
        done = [f for f in self._flights if f.t == steps]
        if done:
            for f in done:
                self._copies.append(_Copy(f, *self.runner.copy_lane(f.lane, steps), is_head=False))
            self.runner.release_lanes([f.lane for f in done])  # queued after the copies
            self._flights = [f for f in self._flights if f.t < steps]
        return out + self._collect_copies(on_head, wait=not self._flights)

    def _start(self, work: list[_Work], use_graphs: bool | None) -> None:
        used = {f.lane for f in self._flights}
        lanes = [lane for lane in range(self.cfg.max_batch) if lane not in used][: len(work)]
        self.runner.start_lanes(
            self._condition_rows(work), [w.req.n_rows for w in work], [w.start_pos for w in work],
            [w.session.slot for w in work], [w.eos_allowed for w in work], torch.stack([w.u for w in work]), lanes,
            use_graphs=use_graphs, temperature=[w.session.temperature for w in work],
            penalty=[w.session.repetition_penalty for w in work])
        steps = self.cfg.max_new_tokens
        self._flights += [_Flight(w, lane, 1, w.start_pos + w.req.n_rows + steps)
                          for w, lane in zip(work, lanes, strict=True)]

    def _collect_copies(self, on_head: Callable[[list[TTSHeadCodes]], None] | None,
                        wait: bool) -> list[TTSUnitResult]:
        """Hand out the copies that are done, in queue order (all of them with `wait`)."""
        heads: list[TTSHeadCodes] = []
        out: list[TTSUnitResult] = []
        while self._copies:
            c = self._copies[0]
            if c.done is not None:
                if not wait and not c.done.query():
                    break
                c.done.synchronize()
            self._copies.popleft()
            row, w = c.host.tolist(), c.flight.work
            if c.is_head:
                if self.mcfg.eos_code not in row and self._live(w):
                    c.flight.head = True
                    heads.append(TTSHeadCodes(w.session.session_id, w.req.fence, w.req.unit_index, tuple(row),
                                              self.cfg.max_new_tokens - 1))
            else:
                out += self._postprocess([w], [row], [self.cfg.first_codes if c.flight.head else 0])
        if heads and on_head is not None:
            on_head(heads)
        return out

    @torch.inference_mode()
    def _condition_rows(self, work: list[_Work]) -> torch.Tensor:
        """[B, T, H] rows cond_1..cond_n, emb_text(audio_bos) at row n, zeros after (§5.1)."""
        dev, dtype = self.runner.device, self.model.emb_text.weight.dtype
        t_max = max(w.req.n_rows for w in work) + 1
        ids = torch.zeros(len(work), t_max, dtype=torch.int64)
        hidden = torch.zeros(len(work), t_max, self.mcfg.llm_dim, dtype=dtype, device=dev)
        for b, w in enumerate(work):
            n = w.req.n_rows
            ids[b, :n] = torch.tensor(w.req.text_ids, dtype=torch.int64)
            hidden[b, :n] = to_device(w.req.hidden, dev).to(dtype)  # row i pairs t_i with its own h_i
        cond = self.model.condition(to_device(ids, dev), hidden)  # [B, T, H]
        n_rows = to_device(torch.tensor([w.req.n_rows for w in work]), dev)
        is_bos = torch.arange(t_max, device=dev)[None] == n_rows[:, None]  # [B, T]
        return torch.where(is_bos[..., None], self.model.audio_bos_row(), cond)

    def _send_heads(self, work: list[_Work], heads: dict[int, TTSHeadCodes],
                    on_head: Callable[[list[TTSHeadCodes]], None], host: torch.Tensor) -> None:
        """host [B, K] int64: every row's first K samples, read back while the unit still runs. A row that
        starts its turn (any row, with `head_every_unit`) sends them, unless they hold EOS (the unit then goes out
        whole, at the end)."""
        eos, unit_codes = self.mcfg.eos_code, self.cfg.max_new_tokens - 1  # the last sample is never fed (Q16)
        for b, (w, row) in enumerate(zip(work, host.tolist(), strict=True)):
            if self._sends_head(w) and eos not in row and self._live(w):
                heads[b] = TTSHeadCodes(w.session.session_id, w.req.fence, w.req.unit_index, tuple(row), unit_codes)
        if heads:
            on_head(list(heads.values()))

    def _sends_head(self, w: _Work) -> bool:
        return w.start_pos == 0 or self.cfg.head_every_unit

    @staticmethod
    def _live(w: _Work) -> bool:
        return w.req.fence.epoch >= w.session.fence.epoch  # a cancel may have fenced it off meanwhile

    def _postprocess(self, work: list[_Work], samples: list[list[int]], sent: list[int]) -> list[TTSUnitResult]:
        """`sent[b]`: how many of row b's codes already went out as a head."""
        eos, out = self.mcfg.eos_code, []
        for b, (w, row) in enumerate(zip(work, samples, strict=True)):
            e = row.index(eos) if eos in row else None
            codes = row[:e] if e is not None else row[:-1]  # the last sample is never fed (Q16)
            draws = e + 1 if e is not None else len(row)
            w.session.commit_draws(w.rng_state, draws)
            end_pos = w.start_pos + w.req.n_rows + 1 + len(codes)
            w.session.tts_pos = 0 if w.req.end_of_turn else end_pos
            w.session.units_done += 1
            self.units_finished += 1
            result = TTSUnitResult(session_id=w.session.session_id, fence=w.req.fence, unit_index=w.req.unit_index,
                                   codes=tuple(codes), eos=e is not None, draws=draws, start_pos=w.start_pos,
                                   end_pos=end_pos, turn_closed=w.req.end_of_turn, head=sent[b])
            if self._live(w):
                out.append(result)
        return out
