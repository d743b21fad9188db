"""Stage0 engine: many duplex sessions on one device (model.md §3, issue 3).

The public calls (`open`, `append`, `cancel`, `update`, `close`) validate, change session bookkeeping
under the engine lock and return; GPU work happens in `step()`, driven by the engine thread (`serve`) or
by a test. The step is the engine's `StepScheduler` (loop.py), built here with the parts it shares with the
requests (parts.py: the session table, the prefix encoder). Every bad request raises a `Stage0Error`
subclass before any state changes.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0.audio_worker import AudioWorker
from engine.stage0.config import DecodeRules, SpecialIds, Stage0Config, TextTokenizer
from engine.stage0.frontend import UnitFrontEnd
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, SharedGraphs
from engine.stage0.loop import StepScheduler
from engine.stage0.parts import PrefixEncoder, SessionTable
from engine.stage0.penalty import HistoryRing
from engine.stage0.runner import ModelRunner
from engine.stage0.sampler_graphs import SamplerGraphs
from engine.stage0.sampling import SamplerIds, SamplingParams, UniformStream
from engine.stage0.script import DecisionScript
from engine.stage0.session import Phase, Session, UnitJob
from engine.stage0.types import (
    BadAudioError,
    BadFrameError,
    BadSamplingError,
    CapacityError,
    Event,
    Fence,
    FrontEndError,
    InvalidFenceError,
    SessionExistsError,
    StaleFenceError,
    TooManyFramesError,
    UnknownSessionError,
)


class Stage0Engine:
    def __init__(self, model: Qwen3LLM, tokenizer: TextTokenizer, frontend: UnitFrontEnd,
                 on_event: Callable[[Event], None], config: Stage0Config | None = None,
                 rules: DecodeRules | None = None) -> None:
        config, rules = config or Stage0Config(), rules or DecodeRules()
        self.model, self.tokenizer, self.frontend = model, tokenizer, frontend
        self.config, self.rules = config, rules
        self.ids = ids = SpecialIds.from_tokenizer(tokenizer, model.cfg.vocab_size)
        if config.fuse_projections and not model.fused:
            model.fuse_projections()  # same parameters (views), so the caller's model is unchanged in value
        model.pad_gemm_rows(config.gemm_tile_rows or config.gemm_min_rows, tile=config.gemm_tile_rows > 0)
        # before any capture: the row counts of the graphs (units of every length in the largest prefill bucket,
        # with the largest decode bucket beside them; the lm_head: a row per session at most) that run as one GEMM
        # with the tiles' bits on this device
        model.verify_gemm_tiles(max(config.prefill_batch_buckets) * max(config.prefill_lengths())
                                + max(config.decode_batch_buckets), logit_rows=config.max_sessions)
        model.flex_keys_per_split = config.flex_keys_per_split
        model.flex_prefill_keys_per_split = config.flex_prefill_keys_per_split
        model.flex_prefill_warps, model.flex_prefill_stages = config.flex_prefill_warps, config.flex_prefill_stages
        p = next(model.parameters())
        kv = SlotKVCache.allocate(model.cfg, config.max_sessions, config.slot_len(rules), dtype=p.dtype,
                                  device=p.device)
        how = dict(enabled=config.use_cuda_graphs or config.eager_replay_graphs, compile_mode=config.compile_mode,
                   eager_replay=config.eager_replay_graphs, compile_dynamic=config.compile_dynamic)
        decode = config.decode_attention
        graphs = DecodeGraphs.create(model, kv, config.decode_batch_buckets, config.decode_kv_buckets,
                                     decode_attention=decode, pad_buckets=config.gemm_pad_buckets, **how)
        flex = config.prefill_attention == "flex" or (config.prefill_attention == "auto" and p.device.type == "cuda")
        prefill = PrefillGraphs.create(model, kv, config.prefill_batch_buckets, config.prefill_lengths(),
                                       config.decode_kv_buckets, flex=flex, pad_buckets=config.gemm_pad_buckets,
                                       **how)
        shared = SharedGraphs.create(graphs, prefill, config.prefill_lengths()[1], max(config.shared_decode_buckets),
                                     enabled=config.mixed_step == "shared", compile_mode=config.compile_mode,
                                     eager_replay=config.eager_replay_graphs, compile_dynamic=config.compile_dynamic)
        self.runner = ModelRunner(model, kv, graphs, prefill, decode_attention=decode, mixed_step=config.mixed_step,
                                  shared_graphs=shared)
        self.table = SessionTable(config.max_sessions)
        self.prefix = PrefixEncoder(tokenizer, frontend, self.runner, config, model.cfg.hidden_size)
        self.lock = threading.RLock()
        self.wake = threading.Event()  # set by every request so an idle `serve()` loop steps at once
        sampler_ids = SamplerIds(chunk_eos=ids.chunk_eos, turn_eos=ids.turn_eos, listen_bias=ids.listen,
                                 masked=(ids.tts_pad, *ids.bad_token_ids, ids.chunk_eos))
        # B2's history on the device, one ring per slot (grows if a session's window is wider)
        history_ring = HistoryRing(config.max_sessions, SamplingParams().repetition_window, model.cfg.vocab_size,
                                   p.device)
        script = DecisionScript(ids, tokenizer.decode, model.cfg.vocab_size, config.script_plan) \
            if config.scripted_decisions else None
        # with the decode graphs, at their batch buckets (a step samples at most one row per slot)
        sampler_graphs = None if graphs is None else SamplerGraphs.create(
            history_ring, sampler_ids, model.cfg.vocab_size, p.dtype, graphs.batch_buckets,
            eager_replay=config.eager_replay_graphs)
        self.scheduler = StepScheduler(
            model=model, tokenizer=tokenizer, frontend=frontend, config=config, ids=ids, runner=self.runner,
            table=self.table, prefix=self.prefix, sampler_ids=sampler_ids, history_ring=history_ring,
            script=script, lock=self.lock, emit=on_event, sampler_graphs=sampler_graphs)

    # ---- what tests, metrics and the Triton bridge read -------------------------------------------
    @property
    def sessions(self) -> dict[str, Session]:
        return self.table.sessions

    @property
    def history_ring(self) -> HistoryRing:
        return self.scheduler.history_ring

    @property
    def script(self) -> DecisionScript | None:
        """The §9.5 benchmark script (`Stage0Config.scripted_decisions`, its plan `script_plan`)."""
        return self.scheduler.script

    @property
    def audio_worker(self) -> AudioWorker | None:
        return self.scheduler.audio_worker

    @property
    def last_rows(self) -> int:
        """Rows the last step fed (batch occupancy)."""
        return self.scheduler.last_rows

    @property
    def last_kind(self) -> str:
        """What the last step with rows ran: "prefill" (a unit, close or prefix row, maybe beside decoded tokens:
        the audio front end and a prefill pass) or "decode" (decoded tokens only)."""
        return self.scheduler.last_kind

    @property
    def last_token_rows(self) -> int:
        """Rows of one decoded token in the last step, in a decode step or beside a prefill row (the shared
        pass): P12's rows per decode step counts these, wherever they ran."""
        return self.scheduler.last_token_rows

    # ---- the step loop ----------------------------------------------------------------------------
    def start_audio_worker(self) -> bool:
        return self.scheduler.start_audio_worker()

    def stop_audio_worker(self) -> None:
        self.scheduler.stop_audio_worker()

    def step(self) -> bool:
        return self.scheduler.step()

    def has_work(self) -> bool:
        with self.lock:
            return any(s.phase is not Phase.IDLE or s.queue for s in self.table.sessions.values())

    def serve(self, stop: threading.Event, idle_wait_s: float = 0.005) -> None:
        """The engine thread's loop: step while there is work, else sleep until a request arrives."""
        while not stop.is_set():
            if not self.step():
                self.wake.wait(idle_wait_s)
                self.wake.clear()

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        steps = 0
        while self.step():
            steps += 1
            if steps >= max_steps:
                raise RuntimeError("engine did not become idle")
        return steps

    # ---- public API -------------------------------------------------------------------------------
    def open(self, session_id: str, fence: Fence, *, prompt: str | None = None,
             ref_audio: torch.Tensor | None = None, params: SamplingParams | None = None,
             force_listen_count: int | None = None, rules: DecodeRules | None = None) -> None:
        """`rules` are the session's decode rules (default: the engine's); `force_listen_count` overrides theirs."""
        params = params or SamplingParams()
        rules = self._session_rules(rules or self.rules, force_listen_count)
        with self.lock:
            if session_id in self.table.sessions:
                raise SessionExistsError(session_id)
            if self.table.slots.free == 0:
                raise CapacityError(f"all {self.config.max_sessions} session slots are in use")
            prompt = self.config.default_prompt if prompt is None else prompt
            prefix = self.prefix.embeds(prompt, ref_audio)
            if prefix.shape[0] + self.config.unit_max_positions(rules) > self.runner.kv.reserved_pos:
                raise CapacityError(f"system prefix of {prefix.shape[0]} positions leaves no room for a unit")
            slot = self.table.slots.take()
            assert slot is not None
            self.table.add(Session(
                session_id=session_id, slot=slot, rules=rules, fence=fence, params=params, prompt=prompt,
                ref_audio=ref_audio, frontend_state=self.frontend.new_state(),
                stream=UniformStream(params.seed), prefix_rows=prefix))
            self.wake.set()

    def append(self, session_id: str, fence: Fence, pcm: torch.Tensor, frames: Sequence[Any] = (),
               *, force_listen_override: bool = False, temperature: float | None = None) -> int:
        """Queues one unit; returns its unit index. `temperature` (>= 0, 0 = greedy) samples this unit only
        with that temperature instead of the session's; later units are unaffected."""
        if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
            raise BadSamplingError(f"{session_id}: unit temperature {temperature} must be finite and >= 0")
        with self.lock:
            s = self.table.live(session_id)
            self._check_fence(s, fence)
            if fence.seq <= s.last_seq:
                raise StaleFenceError(f"{session_id}: append seq {fence.seq} <= last accepted {s.last_seq}")
            expected = self.config.first_unit_samples if s.appended == 0 else self.config.unit_samples
            if s.appended == 0 and pcm.dim() == 1 and pcm.shape[0] == self.config.unit_samples:
                # The sender's unit 0 never got here (an append fenced off by a cancel, F-4), so a later unit is
                # this session's first: it starts the mel stream after the samples unit 0 has beyond it, as
                # zeros. Refused, it would refuse every unit after it too.
                pcm = torch.cat([pcm.new_zeros(expected - pcm.shape[0]), pcm])
            if pcm.dim() != 1 or pcm.shape[0] != expected:
                raise BadAudioError(f"{session_id}: unit {s.appended} needs {expected} samples, "
                                    f"got shape {tuple(pcm.shape)}")
            if len(frames) > self.config.max_frames_per_unit:
                raise TooManyFramesError(f"{session_id}: {len(frames)} frames > {self.config.max_frames_per_unit}")
            if frames and not hasattr(self.frontend, "encode_frame") and not hasattr(self.frontend, "encode_frames"):
                raise FrontEndError("this front end has no vision encoder")
            if len(s.queue) >= self.config.max_queued_units:
                raise CapacityError(f"{session_id}: {len(s.queue)} units already queued (input ahead of real time)")
            images = self._prepare_frames(session_id, frames)
            room = self.runner.kv.reserved_pos - s.cached_len - len(s.pending_close) - s.prefix_to_feed()
            if self.config.eviction == "off" and room < (len(s.queue) + 2) * self.config.unit_max_positions(s.rules):
                raise CapacityError(f"{session_id}: the session context is full (eviction off)")
            s.queue.append(UnitJob(fence=fence, index=s.appended, pcm=pcm, frames=images,
                                   force_listen_override=force_listen_override, temperature=temperature))
            s.appended += 1
            s.last_seq = fence.seq
            self.wake.set()
            return s.appended - 1

    def cancel(self, session_id: str, fence: Fence, next_fence: Fence) -> bool:
        """F-1..F-5 of protocol.md §4.4. Returns False for a late (no-op) cancel."""
        with self.lock:
            s = self.table.live(session_id)
            if (next_fence.incarnation != fence.incarnation or fence.incarnation != s.fence.incarnation
                    or next_fence.epoch != fence.epoch + 1):
                raise InvalidFenceError(f"{session_id}: bad cancel {fence} → {next_fence}")
            if s.fence.epoch > fence.epoch:
                return False
            if fence.epoch > s.fence.epoch:
                raise InvalidFenceError(f"{session_id}: cancel of future epoch {fence.epoch}")
            s.fence = Fence(s.fence.incarnation, next_fence.epoch)
            s.queue.clear()
            unit = s.unit
            if unit is not None:
                unit.aborted = True
                if s.phase in (Phase.FEED, Phase.TURN_EOS):
                    assert unit.decoder is not None
                    unit.terminator = unit.decoder.abort().terminator
                    s.phase = Phase.CLOSE
            if not s.turn.current_turn_ended:
                s.override_next = True  # F-5: the next unit feeds `<|turn_eos|>` and listens
            self.wake.set()
            return True

    def update(self, session_id: str, fence: Fence, *, params: SamplingParams | None = None,
               prompt: str | None = None, rules: DecodeRules | None = None,
               force_listen_count: int | None = None) -> None:
        """Applies from the next unit. A new prompt rebuilds the prefix and drops the retained units. New
        `rules` replace the session's; a `force_listen_count` restarts the count of forced units (§2.4)."""
        with self.lock:
            s = self.table.live(session_id)
            self._check_fence(s, fence)
            new_rules = self._session_rules(rules or s.rules, force_listen_count)
            if params is not None:
                s.pending_params = params
            if prompt is not None:
                s.pending_prompt = prompt
            s.rules = new_rules
            if force_listen_count is not None:
                s.turn.units_generated = 0

    def close(self, session_id: str, fence: Fence) -> bool:
        with self.lock:
            s = self.table.sessions.get(session_id)
            if s is None:
                if session_id in self.table.closed:
                    return False
                raise UnknownSessionError(session_id)
            if fence.incarnation != s.fence.incarnation:
                return False  # a stale close is a no-op
            self.table.remove(s)
            return True

    def session(self, session_id: str) -> Session:
        """Read-only view for tests and metrics (do not mutate)."""
        with self.lock:
            return self.table.live(session_id)

    # ---- helpers ----------------------------------------------------------------------------------
    def _session_rules(self, rules: DecodeRules, force_listen_count: int | None) -> DecodeRules:
        """A session's rules; their unit may not outgrow the engine's (the KV slot is sized by those)."""
        if force_listen_count is not None:
            rules = dataclasses.replace(rules, force_listen_count=force_listen_count)
        if not 1 <= rules.max_steps <= self.rules.max_steps or rules.max_speak_chars_per_unit < 0 \
                or rules.force_listen_count < 0:
            raise BadSamplingError(f"decode rules {rules}: max_steps must be in [1, {self.rules.max_steps}], "
                                   "the character cap and force_listen_count >= 0")
        return rules

    def _prepare_frames(self, session_id: str, frames: Sequence[Any]) -> tuple[Any, ...]:
        """Wire frames -> encoder input (decoded and resized) now, so a bad image fails its append alone."""
        prepare = getattr(self.frontend, "prepare_frame", None)
        if prepare is None:
            return tuple(frames)
        try:
            return tuple(prepare(f) for f in frames)
        except ValueError as exc:
            raise BadFrameError(f"{session_id}: {exc}") from None

    @staticmethod
    def _check_fence(s: Session, fence: Fence) -> None:
        if fence.incarnation != s.fence.incarnation or fence.epoch < s.fence.epoch:
            raise StaleFenceError(f"{s.session_id}: {fence} is stale (current {s.fence})")
        if fence.epoch > s.fence.epoch:
            raise InvalidFenceError(f"{s.session_id}: epoch {fence.epoch} was never adopted")
