"""The engine step: collect → schedule → run → postprocess → emit (STYLE.md practice 2).

Every session with work contributes one row per step: its system prefix, a unit prefill (`<unit>` +
frames + audio), an A1 `<|turn_eos|>`, a decoded token, or a unit close `[terminator, </unit>]`. With
`merge_unit_close` the close is owed instead and fed in front of the next unit's prefill (one forward per
unit, §3.6), and the unit is finished as soon as its terminator is known. The runner routes the rows
(decode graphs, prefill graphs, eager); sampling then runs batched over every row that needs a draw, with
the session's own uniforms, and the ids come back in one read-back, the step's only host sync.

`StepScheduler` is built by the engine (engine.py) with the parts it shares (the session table, the
runner, the sampler's state, the lock, the event callback) and owns what only the step writes: the audio
worker and the rows of the last step. What a step does when something in it raises is its
`StepRecovery` (recovery.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections.abc import Callable

import torch

from engine.hostio import read_back, to_device
from engine.model.llm import Qwen3LLM
from engine.stage0.audio_worker import AudioWorker
from engine.stage0.config import SpecialIds, Stage0Config, TextTokenizer
from engine.stage0.decode import Feed, Stop, UnitDecoder
from engine.stage0.frontend import UnitFrontEnd
from engine.stage0.parts import PrefixEncoder, SessionTable
from engine.stage0.penalty import HistoryRing
from engine.stage0.recovery import StepRecovery
from engine.stage0.runner import ModelRunner, Row
from engine.stage0.sampler_graphs import SamplerGraphs
from engine.stage0.sampling import SamplerIds, SamplingBatch, sample, table_rows
from engine.stage0.script import DecisionScript
from engine.stage0.session import Phase, Session, UnitRecord, UnitRun
from engine.stage0.slots import compact, evict_span
from engine.stage0.types import Event, FrontEndError, TokenEvent, UnitDone

AUDIO_WAIT_S = 1.0  # the longest a step with nothing else to run waits on the audio worker before looking again
TOKEN_PHASES = (Phase.FEED, Phase.TURN_EOS)  # a row of one decoded (or A1) token


class StepScheduler:
    def __init__(self, *, model: Qwen3LLM, tokenizer: TextTokenizer, frontend: UnitFrontEnd, config: Stage0Config,
                 ids: SpecialIds, runner: ModelRunner, table: SessionTable, prefix: PrefixEncoder,
                 sampler_ids: SamplerIds, history_ring: HistoryRing, script: DecisionScript | None,
                 lock: threading.RLock, emit: Callable[[Event], None],
                 sampler_graphs: SamplerGraphs | None = None) -> None:
        self.model, self.tokenizer, self.frontend, self.config = model, tokenizer, frontend, config
        self.ids, self.runner, self.table, self.prefix = ids, runner, table, prefix
        # the sampler's state: B2's history on the device (one ring per slot), the §9.5 script
        self.sampler_ids, self.history_ring, self.script = sampler_ids, history_ring, script
        self.sampler_graphs = sampler_graphs  # the candidate rule captured per batch bucket (CUDA), else eager
        self.lock, self.emit = lock, emit  # the engine's lock: the requests change sessions under it too
        self.recovery = StepRecovery(runner, table, ids, emit)
        self.audio_worker: AudioWorker | None = None  # the front end on its own thread, else in the step
        self.last_rows = 0  # rows the last step fed (batch occupancy)
        self.last_kind = "decode"  # "prefill": the last step had a row of several positions (unit, close, prefix)
        self.last_token_rows = 0  # rows of one decoded token in the last step, beside a prefill or not (P12)

    # ---- the audio worker -------------------------------------------------------------------------
    def start_audio_worker(self) -> bool:
        """Run the batched audio front end on its own thread (audio_worker.py) from now on; False when the
        front end has no batched `encode_units` (units are then encoded in the step, one by one)."""
        encode = getattr(self.frontend, "encode_units", None)
        if encode is None or self.audio_worker is not None:
            return self.audio_worker is not None
        worker = AudioWorker(encode, self.runner.device)
        worker.start()
        self.audio_worker = worker
        return True

    def stop_audio_worker(self) -> None:
        worker, self.audio_worker = self.audio_worker, None
        if worker is not None:
            worker.stop()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        table = self.table
        with self.lock:
            compact(list(table.sessions.values()), table.slots, self.runner.kv)  # decode buckets by live sessions
            sessions = sorted(table.sessions.values(), key=lambda s: s.slot)
            for s in sessions:
                try:
                    self._prepare(s)
                except Exception as exc:  # noqa: BLE001 - e.g. a new prompt whose prefix cannot be built
                    traceback.print_exc()
                    self.recovery.close_failed(s, f"{type(exc).__name__}: {exc}")
            sessions = [s for s in sessions if table.holds(s)]
            held = self._held_units(sessions)
            if held:
                sessions = [s for s in sessions if s.session_id not in held]
        # Outside the lock: requests are accepted while the front end runs. Only this thread (or the audio
        # worker it hands a unit to) touches a session's front-end state and its unit in PREFILL (a cancel
        # only marks that unit aborted).
        self._encode_audio(sessions)
        with self.lock:
            sessions = [s for s in sessions if table.holds(s)]  # closed meanwhile: gone
            self._encode_frames(sessions)
            work = [(s, row) for s in sessions if (row := self._row(s)) is not None]
            self.last_rows = len(work)
            self.last_token_rows = sum(row.embeds is None for _, row in work)
            self.last_kind = "decode" if self.last_token_rows == len(work) else "prefill"
            if work:
                self._run_rows(work)
                return True
        worker = self.audio_worker
        if worker is not None and worker.busy():  # only units waiting on the front end: wait for it
            worker.wait(AUDIO_WAIT_S)
            return True
        return False

    def _held_units(self, sessions: list[Session]) -> set[str]:
        """Sessions whose unit waits this step (`Stage0Config.prefill_hold_ms`): while another session has a
        token to feed, the new units (front end not started) wait together until the oldest of them is the hold
        old; then all of them go, so units that came within one hold share a front-end batch and a prefill step.
        Releasing each unit at its own age instead let them trickle in one or two a step (stop 60)."""
        hold = self.config.prefill_hold_ms / 1000
        if not hold or not any(s.phase in TOKEN_PHASES for s in sessions):
            return set()
        waiting = {s.session_id: u.job.enqueued_at for s in sessions if s.phase is Phase.PREFILL
                   and (u := s.unit) is not None and not u.audio_submitted and u.audio_embeds is None}
        now = time.perf_counter()
        return set() if any(now - t >= hold for t in waiting.values()) else set(waiting)

    def _run_rows(self, work: list[tuple[Session, Row]]) -> None:
        hidden, failed = self.recovery.forward(work)
        for s, exc in failed:
            self.recovery.fail_step(s, exc)
        work = [(s, row) for s, row in work if s.session_id in hidden]
        for s, row in work:
            s.cached_len += row.length
            if s.phase is Phase.PREFILL:
                s.pending_close = ()  # fed in front of this prefill
        try:
            self._postprocess([s for s, _ in work], hidden)
        except Exception as exc:  # noqa: BLE001 - fails the units of this step, never the engine
            for s, _ in work:
                self.recovery.fail_step(s, exc)

    def _row(self, s: Session) -> Row | None:
        """This step's row of `s`; a failure building it, or a row past the KV slot, fails `s` alone."""
        try:
            return self.recovery.check_fits(s, self._schedule(s))
        except Exception as exc:  # noqa: BLE001 - building one session's row fails that session's unit only
            traceback.print_exc()
            self.recovery.fail_step(s, exc)
            return None

    # ---- schedule ---------------------------------------------------------------------------------
    def _schedule(self, s: Session) -> Row | None:
        """This step's row of `s` (after `_prepare`), or None when it has nothing to feed."""
        ids, unit = self.ids, s.unit
        if s.phase is Phase.PREFIX:  # the next chunk of the system prefix (cached_len counts what was fed)
            assert s.prefix_rows is not None
            chunk = self.config.prefix_chunk or s.prefix_rows.shape[0]
            return Row(s.slot, s.cached_len, s.prefix_rows[s.cached_len:s.cached_len + chunk])
        if s.phase is Phase.PREFILL:
            assert unit is not None
            if unit.audio_submitted and unit.audio_embeds is None:
                return None  # its audio is still in the worker
            try:
                embeds = self._unit_embeds(s)
                if s.pending_close:  # §3.6: the previous unit's close merged into this forward
                    embeds = torch.cat([self.runner.embed_marks(*s.pending_close), embeds])
                return Row(s.slot, s.cached_len, embeds)
            except Exception as exc:  # noqa: BLE001 - any encoder failure fails this unit only; nothing was fed
                self.recovery.fail_unit(s, f"{type(exc).__name__}: {exc}")
                return None
        if s.phase is Phase.TURN_EOS:
            return Row(s.slot, s.cached_len, token=ids.turn_eos)
        if s.phase is Phase.FEED:
            assert unit is not None and unit.pending_token is not None
            return Row(s.slot, s.cached_len, token=unit.pending_token)
        if s.phase is Phase.CLOSE:
            assert unit is not None and unit.terminator is not None
            return Row(s.slot, s.cached_len, self.runner.embed_marks(unit.terminator, ids.unit_close))
        return None

    def _prepare(self, s: Session) -> None:
        """Phase changes due before this step's row: a new prefix, an owed close, the next unit."""
        if s.phase is Phase.IDLE and s.pending_prompt is not None:
            s.prompt, s.pending_prompt = s.pending_prompt, None
            s.prefix_rows = self.prefix.embeds(s.prompt, s.ref_audio)
            s.cached_len, s.prefix_len, s.ledger, s.pending_close = 0, 0, [], ()
            s.phase = Phase.PREFIX
        if s.phase is Phase.CLOSE and self.config.merge_unit_close:
            self._defer_close(s)  # a cancel's close: owed to the next prefill like any other
        if s.phase is Phase.IDLE and s.queue:
            self._start_unit(s)

    def _encode_audio(self, sessions: list[Session]) -> None:
        """The audio of every unit started this step through the front end in one batch: handed to the audio
        worker when it runs (the rows go on without it), else here."""
        batch = getattr(self.frontend, "encode_units", None)
        runs = [(s.frontend_state, s.unit) for s in sessions if s.phase is Phase.PREFILL and s.unit is not None
                and s.unit.audio_embeds is None and not s.unit.audio_submitted]
        if batch is None or not runs:
            return
        if self.audio_worker is not None:
            self.audio_worker.submit(runs)
            return
        try:
            encoded = batch([state for state, _ in runs], [unit.job.pcm for _, unit in runs])
        except Exception as exc:  # noqa: BLE001 - the states may have advanced: these units fail, not the engine
            traceback.print_exc()
            encoded = [exc] * len(runs)
        for (_, unit), audio in zip(runs, encoded, strict=True):
            unit.audio_embeds = audio

    def _encode_frames(self, sessions: list[Session]) -> None:
        """Every camera frame of the units prefilled this step, through the vision encoder in one batch."""
        batch = self.frontend.encode_frames if hasattr(self.frontend, "encode_frames") else None
        units = [s.unit for s in sessions if s.phase is Phase.PREFILL and s.unit is not None
                 and s.unit.job.frames and s.unit.frame_embeds is None]
        if batch is None or not units:
            return
        frames = [f for u in units for f in u.job.frames]
        try:
            encoded = batch(frames)
        except Exception:  # noqa: BLE001 - one bad frame must not fail the others: each unit alone
            traceback.print_exc()
            for u in units:
                try:
                    u.frame_embeds = batch(list(u.job.frames))
                except Exception:  # noqa: BLE001 - left unencoded: `_unit_embeds` fails this unit
                    traceback.print_exc()
            return
        for u in units:
            u.frame_embeds, encoded = encoded[:len(u.job.frames)], encoded[len(u.job.frames):]

    def _start_unit(self, s: Session) -> None:
        job = s.queue.popleft()
        if s.pending_params is not None:
            s.params, s.pending_params = s.pending_params, None
        # the override is this unit's only: the session's params stay as they are for the next unit
        params = s.params if job.temperature is None else s.params.with_temperature(job.temperature)
        s.unit = UnitRun(job=job, index=job.index, start_len=s.owed_len, started_at=time.perf_counter(),
                         params=params, turn_before=dataclasses.replace(s.turn), history_len=len(s.history))
        s.phase = Phase.PREFILL

    def _unit_embeds(self, s: Session) -> torch.Tensor:
        """`<unit>` + frame blocks + audio embeddings → [T, H] (§3.3)."""
        assert s.unit is not None
        job, cfg, h = s.unit.job, self.config, self.model.cfg.hidden_size
        parts = [self.runner.embed_marks(self.ids.unit_open)]
        frames = s.unit.frame_embeds
        if frames is None:  # not batched (a front end with `encode_frame` only, or a failed batch)
            if job.frames and not hasattr(self.frontend, "encode_frame"):
                raise FrontEndError(f"unit {job.index}: its frames could not be encoded")
            frames = [self.frontend.encode_frame(frame) for frame in job.frames]
        for f in frames:
            if tuple(f.shape) != (cfg.frame_embeddings, h):
                raise FrontEndError(f"frame embeddings have shape {tuple(f.shape)}")
            parts += [self.runner.embed_marks(self.ids.image_open), f.to(self.runner.device, self.runner.dtype),
                      self.runner.embed_marks(self.ids.image_close)]
        audio = s.unit.audio_embeds
        if isinstance(audio, Exception):
            raise FrontEndError(f"unit {job.index}: the batched audio front end failed: {audio}")
        if audio is None:  # a front end without `encode_units`
            audio = self.frontend.encode_unit(s.frontend_state, job.pcm, job.index)
        if tuple(audio.shape) != (cfg.audio_embeddings_per_unit, h):  # exactly 10 embeddings per unit (I3)
            raise FrontEndError(f"unit {job.index}: audio embeddings have shape {tuple(audio.shape)}")
        parts.append(audio.to(self.runner.device, self.runner.dtype))
        return torch.cat(parts)

    # ---- postprocess ------------------------------------------------------------------------------
    def _postprocess(self, sessions: list[Session], hidden: dict[str, torch.Tensor]) -> None:
        with_logits = [s for s in sessions if s.phase in (Phase.PREFILL, Phase.TURN_EOS, Phase.FEED)]
        logits = {}
        if with_logits:
            last = torch.stack([hidden[s.session_id][-1] for s in with_logits])  # [N, H]
            logits = dict(zip([s.session_id for s in with_logits], self.runner.logits(last), strict=True))
        to_sample: list[Session] = []
        for s in sessions:
            h = hidden[s.session_id]
            if s.phase is Phase.PREFIX:
                assert s.prefix_rows is not None
                if s.cached_len == s.prefix_rows.shape[0]:  # its last chunk: the session may take units
                    s.prefix_len, s.prefix_rows, s.phase = s.cached_len, None, Phase.IDLE
            elif s.phase is Phase.CLOSE:
                self._finish_unit(s)
            elif self._advance(s, h[-1]):
                to_sample.append(s)
        if to_sample:
            self._sample(to_sample, torch.stack([logits[s.session_id] for s in to_sample]))

    def _advance(self, s: Session, h: torch.Tensor) -> bool:
        """After a forward with logits; True when the next step needs a sampled id."""
        unit = s.unit
        assert unit is not None
        if s.phase is Phase.PREFILL:
            unit.decoder = UnitDecoder(self.ids, s.rules, s.turn, self.tokenizer.decode,
                                       force_listen_override=unit.job.force_listen_override or s.override_next)
            s.override_next = False
            if unit.decoder.close_turn_first:  # an override mid-turn feeds <|turn_eos|> first (A1)
                s.phase = Phase.TURN_EOS
                return False
        elif s.phase is Phase.TURN_EOS:
            assert unit.decoder is not None
            unit.decoder.turn_closed()
        elif s.phase is Phase.FEED:
            self._fed(s, h)
        assert unit.decoder is not None
        if unit.decoder.needs_sample():
            return True
        self._act(s, unit.decoder.step(None))
        return False

    def _sample(self, rows: list[Session], logits: torch.Tensor) -> None:
        params, ring, graphs = [s.unit_params for s in rows], self.history_ring, self.sampler_graphs
        ring.sync([(s.slot, s, s.history, p.repetition_window) for s, p in zip(rows, params, strict=True)])
        uniforms, slots = [s.stream.peek(2) for s in rows], [s.slot for s in rows]
        batch = None
        if graphs is not None and graphs.covers(len(rows)):
            out, ring_slots, count = graphs.run(logits, table_rows(params, uniforms, slots,
                                                                   [ring.count[s] for s in slots]))
        else:
            batch = SamplingBatch.from_ring(params, uniforms, ring, slots, logits.device)
            out = torch.stack(sample(logits, batch, self.sampler_ids)).long()
            ring_slots, count = batch.slots, batch.count
        token, draws, appended, exact = read_back(out)  # the sync
        if not all(exact):  # a row's top-k did not fit the candidates (rare): the full-vocabulary rule
            if batch is None:
                batch = SamplingBatch.from_ring(params, uniforms, ring, slots, logits.device)
            out = torch.stack(sample(logits, batch, self.sampler_ids, candidates=None)).long()
            token, draws, appended, _ = read_back(out)
        ids = out[0]
        if self.script is not None:  # §9.5 benchmark mode: the kernels ran, only the id is replaced
            token = [self.script.choose(s.params.seed, s.unit.index, s.unit.decoder.j, t)  # type: ignore[union-attr]
                     for s, t in zip(rows, token, strict=True)]
            ids = to_device(torch.tensor(token, dtype=torch.long), logits.device)
        assert ring_slots is not None and count is not None
        # B7 on the device, from the ids still there (before the graphs' next replay overwrites them); the host
        # history below takes the same ids
        ring.append(ring_slots, count, ids, out[2].bool(), slots)
        for s, t, d, a in zip(rows, token, draws, appended, strict=True):
            assert s.unit is not None and s.unit.decoder is not None
            s.stream.consume(d)
            if a:
                s.history.append(t)
            ring.settle(s.slot, s, len(s.history))
            self._act(s, s.unit.decoder.step(t))

    def _act(self, s: Session, action: Feed | Stop) -> None:
        unit = s.unit
        assert unit is not None and unit.decoder is not None
        unit.token_times.append(time.perf_counter())
        if isinstance(action, Feed):
            unit.pending_token, s.phase = action.token, Phase.FEED
            return
        unit.terminator, s.phase = action.terminator, Phase.CLOSE
        if unit.decoder.j == 0:  # a terminator decision is reported before the close runs
            self.emit(TokenEvent(session_id=s.session_id, fence=unit.job.fence, unit_index=unit.index, j=0,
                                 token_id=action.terminator, text="", hidden=None, end_of_turn=False,
                                 is_tts_row=False, decision=True, listen=unit.decoder.is_listen,
                                 forced=unit.decoder.force))
        if self.config.merge_unit_close:
            self._defer_close(s)

    def _defer_close(self, s: Session) -> None:
        """Finish the unit now and owe `[terminator, </unit>]` to the next prefill (§3.6)."""
        assert s.unit is not None and s.unit.terminator is not None
        s.pending_close = (s.unit.terminator, self.ids.unit_close)
        self._finish_unit(s)

    def _fed(self, s: Session, h: torch.Tensor) -> None:
        unit = s.unit
        assert unit is not None and unit.decoder is not None and unit.pending_token is not None
        dec, j = unit.decoder, unit.decoder.j
        row = dec.fed(unit.pending_token, h)
        text = dec.text
        piece = text[len(s.text_sent):] if text.startswith(s.text_sent) else text
        s.text_sent = text
        self.emit(TokenEvent(session_id=s.session_id, fence=unit.job.fence, unit_index=unit.index, j=j,
                             token_id=unit.pending_token, text=piece, hidden=h, end_of_turn=dec.end_of_turn,
                             is_tts_row=row is not None, decision=j == 0, listen=False, forced=dec.force,
                             sampled_at=_monotonic(unit.token_times[-1])))  # `_act` stamped the pending token
        unit.pending_token = None

    def _finish_unit(self, s: Session) -> None:
        unit = s.unit
        assert unit is not None and unit.decoder is not None and unit.terminator is not None
        dec = unit.decoder
        s.ledger.append(UnitRecord(unit.index, s.owed_len - unit.start_len, tuple(dec.unit_ids), dec.text,
                                   dec.is_listen))
        rows = () if dec.is_listen or unit.aborted else tuple(dec.rows)
        self.emit(UnitDone(session_id=s.session_id, fence=unit.job.fence, unit_index=unit.index,
                           is_listen=dec.is_listen, terminator=unit.terminator, rows=rows, text=dec.text,
                           end_of_turn=dec.end_of_turn, aborted=unit.aborted, metrics=unit.metrics(),
                           forced=dec.force))
        s.unit, s.phase, s.text_sent = None, Phase.IDLE, ""
        self._evict(s)
        s.check_accounting()

    def _evict(self, s: Session) -> None:
        """`basic` mode (§7.4): drop the oldest whole units until the cache is back under `window_low`."""
        if self.config.eviction != "basic" or s.owed_len <= self.config.window_high:
            return
        drop, n = 0, 0
        keep_last = 1 if s.pending_close else 0  # the unit whose close is owed stays in the cache
        while s.owed_len - drop > self.config.window_low and n < len(s.ledger) - keep_last:
            drop += s.ledger[n].span
            n += 1
        evict_span(self.model, self.runner.kv, s.slot, s.prefix_len, drop, s.cached_len)
        s.ledger, s.cached_len = s.ledger[n:], s.cached_len - drop


def _monotonic(perf: float) -> float:
    """A `time.perf_counter()` stamp on `time.monotonic()`'s clock, which other processes of the host share (both are
    CLOCK_MONOTONIC on Linux; the offset keeps this exact where they are not)."""
    return time.monotonic() - (time.perf_counter() - perf)
