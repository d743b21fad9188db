"""Per-session Token2Wav streaming state and `stream(tokens, last)` (model.md §6.3–§6.9).

A call is split in phases so that the engine can batch the heavy ones across sessions:
  flow_phase  pooled session (`slot` set): any mix of rows in one ragged batch (pooled.py), trims
              as index bookkeeping; own FlowCache: batchable only at equal shapes (batch.py)
  trim_phase  (own FlowCache, per session: Q17 estimator trim, Q18 conformer trim)
  hift_phase  (batchable: same mel length, same cached-source length) → speech per session
  finish_phase (per session: cross-fade, HiFT caches, lead-in/tail rule, int16 round trip)
Every tensor a session keeps is owned by it (fresh results, clones or its own pool slot, never views
into scratch, §6.8).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.token2wav.assets import Token2WavModels
from engine.token2wav.batch import run_flow_batch
from engine.token2wav.call import PendingCall  # re-exported: the call a session plans
from engine.token2wav.cfm import EstimatorFn
from engine.token2wav.config import StreamConfig
from engine.token2wav.flow import FlowCache
from engine.token2wav.hift import draw_nsf
from engine.token2wav.pooled import run_flow_pooled
from engine.token2wav.voice import VoiceCache

if TYPE_CHECKING:
    from engine.token2wav.pool import SlotState


class StreamInputError(ValueError):
    """Bad codes or a call that breaks the streaming rules."""


@dataclass
class HiFTCache:
    mel: torch.Tensor       # [1, 80, ≤ 8]
    source: torch.Tensor    # [1, 1, ≤ 3840]
    speech: torch.Tensor    # [1, ≤ 3840]


@dataclass
class UnitPlan:
    """The `stream` calls of one unit (§6.4), or of one part of it, the samples they will emit and the pad:
    §6.6's left pad, or after the calls (`pad_after`) for the rest of a unit whose head already spoke."""

    calls: list[PendingCall]
    samples: int
    pad: int
    end_of_turn: bool
    pad_after: bool = False


@dataclass(frozen=True)
class UnitHead:
    """A unit's head planned ahead of its rest: the samples it emits, its pad included (0: only buffered)."""

    emitted: int


def _empty_hift(device: torch.device, mel_dim: int) -> HiFTCache:
    return HiFTCache(torch.zeros(1, mel_dim, 0, device=device), torch.zeros(1, 1, 0, device=device),
                     torch.zeros(1, 0, device=device))


@dataclass
class SessionStream:
    """One session's Token2Wav state (§6.9). Create with `new_session`."""

    models: Token2WavModels
    voice: VoiceCache
    scfg: StreamConfig
    hift_gen: torch.Generator
    slot: SlotState | None = None         # pooled flow caches (pool.py); None: own FlowCache tensors
    flow_cache: FlowCache | None = field(init=False)   # None while pooled
    hift_cache: HiFTCache = field(init=False)
    buffer: list[int] = field(init=False)
    turn_units: int = field(init=False)

    plan_mel: int = field(init=False)     # HiFT mel-cache frames after every planned call
    head: UnitHead | None = field(init=False)   # a planned head waiting for its rest

    def __post_init__(self) -> None:
        self.reset_turn()

    def reset_turn(self) -> None:
        """Turn start, a turn closed by force-listen (A1) or a cancel: both the planning and the execution
        state (§6.3)."""
        self.reset_plan()
        self.reset_exec()

    def reset_plan(self) -> None:
        self.buffer = [self.scfg.silence_code] * self.scfg.prefix_len
        self.turn_units = 0
        self.plan_mel = 0
        self.head = None

    def reset_exec(self) -> None:
        """Clone the voice's base cache (into the pool slot if pooled); empty HiFT caches. The base
        cache itself is never written."""
        if self.slot is not None:
            self.slot.load(self.voice)
            self.flow_cache = None
        else:
            self.flow_cache = self.voice.flow.clone()
        self.hift_cache = _empty_hift(self.voice.spk_proj.device, self.models.flow_cfg.mel_dim)

    def owned_tensors(self) -> list[torch.Tensor]:
        h = self.hift_cache
        flow = self.slot.views() if self.flow_cache is None else list(self.flow_cache.tensors())
        return [*flow, h.mel, h.source, h.speech]

    # ---------------------------------------------------------------- unit planning: buffer and flush (§6.4)
    def check_codes(self, codes: Sequence[int]) -> None:
        vocab = self.models.flow_cfg.vocab_size
        bad = [c for c in codes if not isinstance(c, (int, np.integer)) or not 0 <= int(c) < vocab]
        if bad:
            raise StreamInputError(f"codes out of range [0, {vocab}): {bad[:5]}")

    def plan_unit(self, codes: Sequence[int], end_of_turn: bool) -> UnitPlan:
        """Buffer the codes and cut them into `stream` calls, the last one at end of turn (§6.4 rules 1–3,
        plus the optional smaller first hop), on the planning buffer.

        Planning runs ahead of execution, so an engine can queue several units; the end-of-turn
        unit resets the planning state at once and the execution state after its last call.
        """
        self.check_codes(codes)
        return self._close_unit(self._cut(codes, end_of_turn, first_hop=True), end_of_turn, emitted=0)

    def plan_head(self, codes: Sequence[int], unit_codes: int | None, every_unit: bool = False) -> UnitPlan:
        """A unit's first codes, sent ahead of the rest so that a turn's first audio need not wait for the
        whole unit. In a turn's first unit (in any unit, with `every_unit`) they make one early call, the
        buffered codes + head, as the `first_hop` call does, led by the §6.6 left pad that a whole unit of
        `unit_codes` codes would get; elsewhere (or with fewer than `min_call` codes buffered) they are only
        buffered. The unit is counted by its rest (`plan_rest`)."""
        self.check_codes(codes)
        if self.head is not None:
            raise StreamInputError("a head is already waiting for its rest")
        s = self.scfg
        calls: list[PendingCall] = []
        pad = 0
        if (self.turn_units == 0 or every_unit) and len(self.buffer) + len(codes) >= self.min_call:
            pad = self._whole_unit_pad(codes, unit_codes)
            hop = min(len(codes), s.chunk_new)    # one call adds at most chunk_call codes (the pool's caps)
            self.buffer.extend(int(c) for c in codes)
            calls.append(PendingCall(self.buffer[:s.prefix_len + hop], False))
            self.buffer = self.buffer[hop:]       # keeps the look-ahead, as the first hop does
        else:
            self.buffer.extend(int(c) for c in codes)
        samples = self._plan_samples(calls)
        self.head = UnitHead(pad + samples)
        return UnitPlan(calls, samples, pad, False)

    def plan_rest(self, codes: Sequence[int], end_of_turn: bool) -> UnitPlan:
        """The rest of a unit whose head was planned: the flush rules go on from the head's buffer and the
        unit counts once. A head that only buffered leaves exactly the whole unit's plan. After a head that
        spoke, a short unit (not end of turn) is padded to `unit_samples` AFTER this part's calls
        (`pad_after`), not before them as §6.6 pads: the head's audio is out already, and zeros in front
        of the rest would cut a gap into the middle of the unit's speech."""
        self.check_codes(codes)
        if self.head is None:
            raise StreamInputError("a rest without its head")
        emitted, self.head = self.head.emitted, None
        # a head that spoke was the turn's first hop already
        plan = self._close_unit(self._cut(codes, end_of_turn, first_hop=not emitted), end_of_turn, emitted)
        plan.pad_after = emitted > 0
        return plan

    @property
    def min_call(self) -> int:
        """Codes a non-last call needs: the look-ahead conv leaves >= 2 frames for its cache."""
        return self.scfg.prefix_len + self.models.flow_cfg.pre_lookahead_conv2_kernel - 1

    def _cut(self, codes: Sequence[int], end_of_turn: bool, first_hop: bool) -> list[PendingCall]:
        s = self.scfg
        self.buffer.extend(int(c) for c in codes)
        calls: list[PendingCall] = []
        if first_hop and self.turn_units == 0 and s.first_hop and len(self.buffer) >= s.prefix_len + s.first_hop:
            m = s.prefix_len + s.first_hop          # earlier first audio: a short first call
            calls.append(PendingCall(self.buffer[:m], False))
            self.buffer = self.buffer[s.first_hop:]
        flush_all = s.force_flush == "always" or self.turn_units == 0
        threshold = s.min_flush if flush_all else s.chunk_call
        while len(self.buffer) >= threshold:
            m = min(s.chunk_call, len(self.buffer))
            calls.append(PendingCall(self.buffer[:m], False))
            self.buffer = self.buffer[min(s.chunk_new, m - s.prefix_len):]
        if end_of_turn and self.buffer:
            calls.append(PendingCall(self.buffer, True))
            self.buffer = []
        return calls

    def _close_unit(self, calls: list[PendingCall], end_of_turn: bool, emitted: int) -> UnitPlan:
        """Count the unit, size its pad (`emitted`: what its head put out already) and end the turn."""
        self.turn_units += 1
        samples = self._plan_samples(calls)
        pad = 0 if end_of_turn else max(0, self.scfg.unit_samples - emitted - samples)
        if end_of_turn:
            self.reset_plan()
        return UnitPlan(calls, samples, pad, end_of_turn)

    def _whole_unit_pad(self, head: Sequence[int], unit_codes: int | None) -> int:
        """The left pad of a whole unit of `unit_codes` codes: a dry run of `plan_unit` on a copy of the
        planning state, silence codes standing in for the codes still to come. 0 when the size is unknown,
        and when that unit would make no call (§6.6 would render it all silence, so there is no
        position of its audio to keep)."""
        if unit_codes is None or unit_codes <= len(head):
            return 0
        saved = (list(self.buffer), self.turn_units, self.plan_mel)
        try:
            dry = self.plan_unit([*head, *[self.scfg.silence_code] * (unit_codes - len(head))], end_of_turn=False)
        finally:
            self.buffer, self.turn_units, self.plan_mel = saved
        return dry.pad if dry.calls else 0

    def _plan_samples(self, calls: Sequence[PendingCall]) -> int:
        """Samples these calls will emit (§6.5 step 7), known before any of them runs."""
        spf = self.models.hift_cfg.samples_per_frame
        total = 0
        for c in calls:
            n = len(c.tokens)
            frames = self.models.flow_cfg.up_stride * (n if c.last else n - self.scfg.prefix_len)
            total += (self.plan_mel + frames) * spf if c.last else frames * spf
            self.plan_mel = min(self.scfg.mel_cache_frames, self.plan_mel + frames)
        return total

    # ------------------------------------------------------------------ phases of one call (§6.5)
    def trim_phase(self, cache: FlowCache) -> FlowCache:
        s, p = self.scfg, self.voice.prompt_frames
        keep = s.cache_keep_frames
        est = cache.estimator_att
        if est.shape[4] > p + keep:
            head, tail = (p, keep) if s.flow_cache_trim == "reference" else (keep, p)
            est = torch.cat([est[:, :, :, :, :head], est[:, :, :, :, -tail:]], dim=4)
        att = cache.conformer_att
        if att.shape[3] > p + keep:
            if s.conformer_cache_trim == "v0.1.2":
                att = torch.cat([att[:, :, :, :p], att[:, :, :, -keep:]], dim=3)
            else:
                stride, n_tok = self.models.flow_cfg.up_stride, self.models.flow_cfg.enc_blocks
                tok = att[:n_tok, :, :, : att.shape[3] // stride]
                tok = torch.cat([tok[:, :, :, : p // stride], tok[:, :, :, -(keep // stride):]], dim=3)
                mel = att[n_tok:]
                mel = torch.cat([mel[:, :, :, :p], mel[:, :, :, -keep:]], dim=3)
                att = torch.cat([tok.repeat(1, 1, 1, stride, 1), mel], dim=0)
        return FlowCache(cache.conformer_cnn, att, cache.estimator_cnn, est)

    def hift_inputs(self, call: PendingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        assert call.mel is not None
        mel = torch.cat([self.hift_cache.mel, call.mel.to(self.hift_cache.mel.dtype)], dim=2)   # fp16 flow option
        rand_ini, noise = draw_nsf(self.hift_gen, mel.shape[2], self.models.hift_cfg, mel.device)
        return mel, self.hift_cache.source, rand_ini, noise

    def finish_phase(self, call: PendingCall, mel_in: torch.Tensor, speech: torch.Tensor,
                     source: torch.Tensor) -> np.ndarray:
        """Cross-fade, update HiFT caches, apply the lead-in/tail rule; returns int16 PCM."""
        n_over = self.scfg.mel_cache_frames * self.models.hift_cfg.samples_per_frame
        cached = self.hift_cache.speech
        first = cached.shape[-1] == 0
        if not first:
            w = _hamming(2 * n_over, speech.device)
            speech = speech.clone()
            speech[:, :n_over] = speech[:, :n_over] * w[:n_over] + cached[:, -n_over:] * w[n_over:]
        self.hift_cache = HiFTCache(mel_in[:, :, -self.scfg.mel_cache_frames:].clone(),
                                    source[:, :, -n_over:].clone(), speech[:, -n_over:].clone())
        if not call.last:
            speech = speech[:, :-n_over]
            if first:
                speech = torch.cat([speech.new_zeros(1, n_over), speech], dim=1)
        return to_pcm16(speech[0], self.scfg)

    # ------------------------------------------------------------------ single-session entry points
    @torch.inference_mode()
    def stream(self, tokens: Sequence[int], last: bool, estimator: EstimatorFn | None = None) -> np.ndarray:
        """One `stream(tokens, last)` call (§6.5) for this session alone; returns int16 PCM at 24 kHz."""
        self.check_codes(tokens)
        min_len = 1 if last else self.min_call
        if len(tokens) < min_len:
            raise StreamInputError(f"stream: {len(tokens)} tokens are too few (last={last})")
        call = PendingCall([int(t) for t in tokens], last)
        if self.slot is not None:
            run_flow_pooled(self.models, self.slot.pool, [self], [call])
        else:
            run_flow_batch(self.models, [self], [call], estimator)
        mel, src, ini, noise = self.hift_inputs(call)
        speech, source = self.models.hift(mel, src, ini, noise)
        return self.finish_phase(call, mel, speech, source)

    def synthesize_unit(self, codes: Sequence[int], end_of_turn: bool) -> np.ndarray:
        """Buffer and flush one speak unit's codes (§6.4), a short unit left-padded to 1 s (§6.6); returns the
        unit's float32 audio (int16 / 32768)."""
        plan = self.plan_unit(codes, end_of_turn)
        pcm = [np.zeros(plan.pad, np.int16)] + [self.stream(c.tokens, c.last) for c in plan.calls]
        if end_of_turn:
            self.reset_exec()
        out = np.concatenate(pcm)
        assert out.shape[0] == plan.samples + plan.pad
        return out.astype(np.float32) / self.scfg.pcm_unscale


@functools.lru_cache(maxsize=8)
def _hamming(n: int, device: torch.device) -> torch.Tensor:
    """Symmetric Hamming window in float64, as the reference's np.hamming; read-only, cached per device."""
    return torch.from_numpy(np.hamming(n)).to(device)


def to_pcm16(speech: torch.Tensor, scfg: StreamConfig) -> np.ndarray:
    """clip → ×32767 in fp32 → int16 by truncation toward zero (Q23)."""
    return (speech.float().clamp(-1.0, 1.0) * scfg.pcm_scale).to(torch.int16).cpu().numpy()


def new_session(models: Token2WavModels, voice: VoiceCache, scfg: StreamConfig, seed: int,
                slot: SlotState | None = None) -> SessionStream:
    device = voice.spk_proj.device
    return SessionStream(models, voice, scfg, torch.Generator(device=device).manual_seed(seed), slot)
