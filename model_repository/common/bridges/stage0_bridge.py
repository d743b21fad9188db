"""Stage0 bridge: Triton requests <-> engine.stage0.Stage0Engine (thinker: audio and camera in, decisions/text out).

An append's CONFIG may carry the unit's own thinker temperature (`options.unit_temperature`, the
response-scoped option of protocol.md §2.8); the session's sampling stays as it is for the other units.
The system prefix carries a reference clip (model.md §3.2): the client's `ref_audio`, else the clip of the
session's voice pack. An append's FRAMES (JPEG/PNG) go through SigLIP + the resampler into the unit's prompt.

Per unit the sink sees `decision`, `text`…, then for every speak unit `tts_input` (TOKENS = text ids of
the TTS rows, HIDDEN = their LLM states flattened [n * hidden_dim]; n = 0 when the unit's first sampled token
ended it, model.md §3.7 Q11) and last `unit_done` with the thinker metrics the gateway reads ({"thinker":
{"tokens", "ttft_ms", "token_times_ms"}}). Decisions/text come from the engine's `on_event` callback, which
runs on the engine thread inside `step()`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.audio.frontend import AudioFrontEnd
from engine.loader import load_checkpoint
from engine.loader.checkpoint import THINKER_COMPONENTS
from engine.stage0 import Fence, Stage0Config, Stage0Engine, TokenEvent, UnitDone
from engine.stage0.frontend import AudioFrontEndAdapter, VisionFrames
from engine.stage0.script import ScriptPlan

from ..codec import RequestError, StageOutput, StageRequest
from ..settings import ConfigError, StageSettings
from .base import (
    EngineBridge,
    configure_torch,
    control_event,
    count_option,
    engine_options,
    flag_option,
    session_key,
    torch_dtype,
)
from .options import (
    check_config,
    decode_rules,
    force_listen_count,
    instructions,
    ref_audio,
    sampling_params,
    seed_of,
    text_only,
    unit_temperature,
    voice_of,
)

MS_PER_S = 1000.0
WINDOW_LOW_FRACTION = 0.75  # eviction drops old units down to this share of the KV window (§7.4)

WARM_SESSION_BATCHES = (1, 2, 4, 8, 16)  # sessions opened at once by the warm-up (capped at max_sessions)
# deploy profile `engine_options.stage0` keys
OPTIONS = ("audio_worker", "compile_mode", "cuda_graphs", "decode_attention", "flex_keys_per_split",
           "flex_prefill_keys_per_split", "flex_prefill_stages", "flex_prefill_warps", "gemm_min_rows",
           "gemm_pad_buckets", "gemm_tile_rows", "merge_unit_close", "mixed_step", "prefill_attention",
           "prefill_batch_buckets", "prefill_hold_ms", "prefix_chunk", "scripted_decisions", "shared_decode_buckets")
PLAN_KEYS = ("listen_units", "speak_units", "text_ids_per_unit", "tail_listen_units")  # ScriptPlan's fields


DEFAULT_VOICE = "default"


@dataclass
class _Unit:
    sink: Any
    accepted_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Session:
    corrid: int
    seed: int
    voice: tuple[Any, ...]  # what chose the prefix's clip: (CONFIG voice, CONFIG ref_audio)
    text_only: bool = False  # no `tts_input`: nothing for the talker and the vocoder to do
    units: dict[int, _Unit] = field(default_factory=dict)
    started: int = 0  # units whose decision the engine reached
    in_turn: bool = False  # a speak unit opened a turn that no `end_of_turn` has closed yet


def _buckets(opts: dict[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """A list of batch buckets (positive ints) as a Stage0Config keyword; absent: {} (the config's default)."""
    if name not in opts:
        return {}
    value = opts[name]
    if not isinstance(value, list) or not value or not all(isinstance(b, int) and b > 0 for b in value):
        raise ConfigError(f"engine_options.stage0.{name} must be a list of positive integers, not {value!r}")
    return {name: tuple(value)}


def kernel_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The Stage0Config keywords of the engine options that shape a step's kernels (compile, attention, GEMM rows
    and tiles, mixed steps, the shared pass's buckets): what a benchmark takes from a deploy profile so it times
    the served kernels (bench/bench_stage0.py --profile)."""
    return dict(compile_mode=opts.get("compile_mode"), merge_unit_close=bool(opts.get("merge_unit_close", True)),
                mixed_step=opts.get("mixed_step", "split"), prefill_attention=opts.get("prefill_attention", "auto"),
                decode_attention=opts.get("decode_attention", "matmul"),
                **count_option(opts, "stage0", "gemm_min_rows"), **count_option(opts, "stage0", "gemm_tile_rows"),
                **count_option(opts, "stage0", "flex_keys_per_split"),
                **count_option(opts, "stage0", "flex_prefill_keys_per_split"),
                **count_option(opts, "stage0", "flex_prefill_warps"),
                **count_option(opts, "stage0", "flex_prefill_stages"),
                gemm_pad_buckets=flag_option(opts, "stage0", "gemm_pad_buckets", True),
                **_buckets(opts, "shared_decode_buckets"))


class Stage0Bridge(EngineBridge):
    def __init__(self, settings: StageSettings) -> None:
        super().__init__(settings)
        configure_torch(settings)
        opts = engine_options(settings, OPTIONS)
        ck = load_checkpoint(settings.checkpoint_dir, device=settings.device, dtype=torch_dtype(settings),
                             with_vision=True, with_token2wav=False, components=THINKER_COMPONENTS)
        model = ck.model
        vision = VisionFrames(model.vpm, model.resampler) if model.vpm is not None else None
        # log-mel on the stage's device: one batched STFT per step over every unit's window (engine/audio); the
        # sessions' encoder KV in one pool, so a step gathers and scatters it once per layer (issue 15)
        audio = AudioFrontEnd(model.apm, model.audio_projection_layer, ck.config.audio, mel_device=settings.device,
                              kv_slots=settings.max_sessions)
        frontend = AudioFrontEndAdapter(audio, vision)
        # the voices' reference clips (model.md §3.2: the prefix and the Token2Wav prompt use the same clip)
        self.voice_clips = {v: ck.voice(v).ref_audio_16k for v in ck.voices()}
        self.default_voice = DEFAULT_VOICE if DEFAULT_VOICE in self.voice_clips else min(self.voice_clips, default="")
        cfg = Stage0Config(max_sessions=settings.max_sessions, window_high=settings.kv_window,
                           window_low=max(1, int(settings.kv_window * WINDOW_LOW_FRACTION)),
                           use_cuda_graphs=settings.device.startswith("cuda") and opts.get("cuda_graphs", True),
                           **kernel_options(opts), **count_option(opts, "stage0", "prefix_chunk"),
                           **count_option(opts, "stage0", "prefill_hold_ms"),
                           **_buckets(opts, "prefill_batch_buckets"),
                           **scripted_decisions(opts.get("scripted_decisions")))
        self.hidden_dim = ck.config.llm.hidden_size
        self.engine = Stage0Engine(model.llm, ck.tokenizer, frontend, self._on_event, cfg)
        # off by default: measured on the H200 at 16 sessions (bench/RESULTS.md), the worker halves the stage0
        # step and commit->first audio p50 but the two threads then share one GIL-bound core and the tails grow
        # (unit->decision p99 1724 vs 732 ms, underruns 8.5 vs 1.9 s)
        self.use_audio_worker = flag_option(opts, "stage0", "audio_worker")
        self.terminators = self.engine.ids.terminators
        self.sessions: dict[str, _Session] = {}

    def warm_up(self, emit: Callable[[str], None]) -> None:
        """The decode / prefill graphs were captured when the engine was built; here the audio encoder's graphs
        are captured (with the engine's CUDA graphs) and the batched audio front end runs once at batch 1 and
        at max_sessions (cuFFT / cuBLAS plans, its allocator blocks)."""
        audio = self.engine.frontend.audio
        if self.engine.config.use_cuda_graphs:
            audio.capture_graphs(emit)
        for b in sorted({1, self.settings.max_sessions}):
            self._warm_front_end(b)
            emit(f"audio front end: batch {b}")
        if self.settings.device.startswith("cuda"):
            self.warm_sessions(emit)

    def _warm_front_end(self, batch: int) -> None:
        """One front-end call at `batch` units. Its states hold pool slots until they are dropped, on return."""
        audio = self.engine.frontend.audio
        states = [audio.new_session() for _ in range(batch)]
        audio.encode_units(states, [torch.zeros(self.engine.config.first_unit_samples)] * batch)

    def warm_sessions(self, emit: Callable[[str], None], units: int = 2) -> None:
        """Sessions as the first served ones run, at the batch sizes of a first wave of users: k sessions open at
        once (their system prefixes' eager prefill, with the default voice's clip) and send `units` units each
        (front end, unit prefill, decode at k rows), then close, so that the kernel plans of those shapes (cuDNN
        attention per prefix batch and length, cuFFT per mel batch) exist before ready. On the H200 this took a
        cold server's first 16-session level from 330 / 563 ms to first audio to 234 / 341 ms (warm: 228 / 286;
        bench/RESULTS.md, stop 27). The engine is driven directly: no sink, no stage metric."""
        eng, n = self.engine, self.settings.max_sessions
        clip = self.voice_clips.get(self.default_voice) if self.voice_clips else None
        for k in sorted({min(b, n) for b in WARM_SESSION_BATCHES}):
            sids = [f"__warmup_{k}_{i}" for i in range(k)]
            fence = Fence(0, 0)
            for i, sid in enumerate(sids):
                eng.open(sid, fence, ref_audio=clip, params=sampling_params({}, i))
            eng.run_until_idle()
            for unit in range(units):
                samples = eng.config.first_unit_samples if unit == 0 else eng.config.unit_samples
                for sid in sids:
                    eng.append(sid, Fence(0, 0, unit), torch.zeros(samples))
                eng.run_until_idle()
            for sid in sids:
                eng.close(sid, fence)
            emit(f"sessions: {k} at once, {units} units each")

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, req: StageRequest, sink: Any) -> None:
        """An append's camera frames are decoded and resized here, on the adapter's thread (Pillow releases the
        GIL), so the engine thread only encodes them. A frame that fails here stays bytes and fails its
        append on the engine thread, typed (`Stage0Engine.append`)."""
        prepare = getattr(self.engine.frontend, "prepare_frame", None)
        if req.op == "append" and req.frames and prepare is not None:
            req = dataclasses.replace(req, frames=tuple(_prepared(prepare, f) for f in req.frames))
        super().submit(req, sink)

    def handle(self, req: StageRequest, sink: Any) -> None:
        sid, fence = session_key(req.corrid), Fence(req.fence[0], req.fence[1], req.fence[2])
        if req.op == "open":
            self._open(sid, fence, req.corrid, req.config or {})
        elif req.op == "append":
            self._append(sid, fence, req, sink)
            return  # the sink closes at the unit's UnitDone
        elif req.op == "update":
            self._update(sid, fence, req.config or {})
        elif req.op == "cancel":
            assert req.next_fence is not None
            self.engine.cancel(sid, fence, Fence(*req.next_fence))
            self._close_dropped(sid)
        elif req.op == "close":
            self.engine.close(sid, fence)
            self._end(sid)
        sink.emit(control_event(req, "stage0"))
        sink.close()

    def _open(self, sid: str, fence: Fence, corrid: int, cfg: dict[str, Any]) -> None:
        check_config(cfg)
        seed = seed_of(cfg)
        self.engine.open(sid, fence, prompt=instructions(cfg), ref_audio=self._clip(cfg),
                         params=sampling_params(cfg, seed), rules=decode_rules(cfg, self.engine.rules),
                         force_listen_count=force_listen_count(cfg))
        self.sessions[sid] = _Session(corrid, seed, _voice_key(cfg), text_only=bool(text_only(cfg)))

    def _clip(self, cfg: dict[str, Any]) -> torch.Tensor | None:
        """The prefix's reference clip: the client's, else the voice's (None without voices)."""
        clip = ref_audio(cfg)
        if clip is not None or not self.voice_clips:
            return clip
        return self.voice_clips[voice_of(cfg, self.voice_clips, self.default_voice)]

    def _update(self, sid: str, fence: Fence, cfg: dict[str, Any]) -> None:
        """A runtime update: sampling, rules, force-listen and output mode from the next unit; a new prompt
        rebuilds the prefix. A new seed, voice or clip re-opens the session before its first unit and is
        refused after it (the gateway locks them at the prefix commit, protocol.md §2.6)."""
        if not cfg:
            return
        check_config(cfg)
        state = self.sessions.get(sid)
        live = self.engine.session(sid)  # raises for an unknown session
        assert state is not None
        new_seed = cfg.get("seed") is not None and seed_of(cfg) != state.seed
        new_voice = ("voice" in cfg or "ref_audio" in cfg) and _voice_key(cfg) != state.voice  # absent: unchanged
        if new_seed or new_voice:
            if live.appended:
                raise RequestError("invalid_runtime_config",
                                   "CONFIG seed, voice and ref_audio cannot change after the first unit")
            self.engine.update(sid, fence)  # checks the fence; the session is then opened again, seeded anew
            self.engine.close(sid, live.fence)
            self._open(sid, live.fence, state.corrid, cfg)
            return
        flc = force_listen_count(cfg)  # every update carries it: only a new value restarts the count
        prompt = instructions(cfg)  # every update carries it too: only a new prompt rebuilds the prefix
        prompt = None if prompt == (live.pending_prompt or live.prompt) else prompt
        self.engine.update(sid, fence, params=sampling_params(cfg, state.seed), prompt=prompt,
                           rules=decode_rules(cfg, live.rules),
                           force_listen_count=None if flc == live.rules.force_listen_count else flc)
        mode = text_only(cfg)
        if mode is not None:
            state.text_only = mode

    def _append(self, sid: str, fence: Fence, req: StageRequest, sink: Any) -> None:
        if req.pcm is None:
            raise RequestError("bad_audio", "append needs PCM")
        state = self.sessions.get(sid)
        temperature = unit_temperature(req.config or {})  # a bad value fails this append only, before any change
        pcm = torch.from_numpy(np.ascontiguousarray(req.pcm, dtype=np.float32))
        index = self.engine.append(sid, fence, pcm, req.frames, force_listen_override=bool(req.force_listen),
                                   temperature=temperature)
        assert state is not None  # the engine raised for an unknown session
        state.units[index] = _Unit(sink)

    def start(self) -> None:
        # the batched audio front end on its own thread: a unit's Whisper pass no longer holds up the other
        # sessions' rows (engine/stage0/audio_worker.py); without `audio_worker: true` it runs in the step
        if self.use_audio_worker:
            self.engine.start_audio_worker()
        super().start()

    def stop(self) -> None:
        super().stop()
        self.engine.stop_audio_worker()

    def step(self) -> bool:
        busy = self.engine.step()
        # a row is one session's forward in this step (prefix, unit prefill, token or close)
        self.step_rows, self.step_kind = self.engine.last_rows, self.engine.last_kind
        self.step_token_rows = self.engine.last_token_rows
        return busy

    def forget(self, corrid: int) -> None:
        sid = session_key(corrid)
        live = self.engine.sessions.get(sid)
        if live is not None:
            self.engine.close(sid, live.fence)
        self._end(sid)

    def fail_all(self, out: StageOutput) -> None:
        for state in self.sessions.values():
            for unit in state.units.values():
                unit.sink.emit(out)
                unit.sink.close()
            state.units.clear()

    def _end(self, sid: str) -> None:
        state = self.sessions.pop(sid, None)
        if state is not None:
            for index, unit in state.units.items():
                unit.sink.emit(_dropped(index))
                unit.sink.close()

    def _close_dropped(self, sid: str) -> None:
        """A cancel drops queued units without a UnitDone: end their requests here."""
        state = self.sessions.get(sid)
        live = self.engine.sessions.get(sid)
        running = live.unit.index if live is not None and live.unit is not None else None
        for index in [i for i in state.units if i != running] if state else []:
            unit = state.units.pop(index)
            unit.sink.emit(_dropped(index))
            unit.sink.close()

    # ---- engine events (engine thread, inside step) -------------------------------------------------
    def _on_event(self, ev: TokenEvent | UnitDone) -> None:
        state = self.sessions.get(ev.session_id)
        unit = state.units.get(ev.unit_index) if state else None
        if state is None or unit is None:
            return
        if isinstance(ev, TokenEvent):
            if ev.decision:  # the engine's verdict: `listen` iff it decided `<|listen|>` (its unit_done agrees)
                state.started += 1
                action = "listen" if ev.listen else "speak"
                unit.sink.emit(StageOutput({"type": "decision", "action": action, "decision": action,
                                            "unit": ev.unit_index, "forced": ev.forced}))
            elif ev.text:
                unit.sink.emit(StageOutput({"type": "text", "token_id": ev.token_id, "text": ev.text,
                                            "unit": ev.unit_index, "sampled_at": ev.sampled_at}))
            return
        del state.units[ev.unit_index]
        self._unit_done(state, unit, ev)

    def _unit_done(self, state: _Session, unit: _Unit, ev: UnitDone) -> None:
        if ev.error is not None:
            unit.sink.emit(StageOutput({"type": "error", "code": ev.error_code, "message": ev.error,
                                        "unit": ev.unit_index}))
            unit.sink.close()
            return
        if not ev.is_listen and not ev.aborted and not state.text_only:
            # every speak unit goes to the TTS, also one with no rows (its first sampled token ended it): the
            # reference synthesises it from the `audio_bos` row alone and advances the turn (model.md §3.7, Q11)
            turn_start = not state.in_turn
            state.in_turn = not ev.end_of_turn
            hidden = _hidden_rows(ev.rows, self.hidden_dim)  # [n, H], n >= 0
            unit.sink.emit(StageOutput(
                {"type": "tts_input", "unit": ev.unit_index, "is_turn_eos": [bool(r.is_turn_eos) for r in ev.rows],
                 "end_of_turn": ev.end_of_turn, "turn_start": turn_start, "hidden_dim": self.hidden_dim},
                tokens=np.array([r.token_id for r in ev.rows], dtype=np.int64), hidden=hidden.reshape(-1)))
        elif ev.end_of_turn or ev.aborted:
            state.in_turn = False
        m = ev.metrics
        unit.sink.emit(StageOutput({
            "type": "unit_done", "unit": ev.unit_index, "is_listen": ev.is_listen, "end_of_turn": ev.end_of_turn,
            "forced": ev.forced, "aborted": ev.aborted, "text": ev.text,
            "metrics": {"thinker": {"tokens": m.tokens, "ttft_ms": m.ttft_s * MS_PER_S,
                                    "token_times_ms": _token_times_ms(m.ttft_s, m.itl_s),
                                    "queue_ms": m.queue_s * MS_PER_S}}}))
        unit.sink.close()


def scripted_decisions(value: Any) -> dict[str, Any]:
    """`engine_options.stage0.scripted_decisions` -> Stage0Config arguments ({} when absent).

    A benchmark plan for random weights (engine/stage0/script.py): every kernel runs, only the sampled ids
    follow the plan. The deploy profile is the benchmark entry point that sets `benchmark_mode`."""
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - set(PLAN_KEYS):
        raise ConfigError(f"engine option scripted_decisions must be a mapping of {PLAN_KEYS}, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise ConfigError(f"engine option scripted_decisions: values must be integers >= 0, got {value!r}")
    plan = ScriptPlan(**value)
    if plan.speak_units < 1:
        raise ConfigError("engine option scripted_decisions: speak_units must be >= 1")
    return {"scripted_decisions": True, "benchmark_mode": True, "script_plan": plan}


def _hidden_rows(rows: tuple[Any, ...], hidden_dim: int) -> np.ndarray:
    """The rows' LLM states as fp32 [n, hidden_dim] on the host; [0, hidden_dim] for a unit without rows."""
    if not rows:
        return np.zeros((0, hidden_dim), dtype=np.float32)
    return torch.stack([r.hidden for r in rows]).to(torch.float32).cpu().numpy()


def _prepared(prepare: Callable[[Any], Any], frame: bytes) -> Any:
    try:
        return prepare(frame)
    except ValueError:
        return frame  # decoded again at append, where the error becomes the append's


def _voice_key(cfg: dict[str, Any]) -> tuple[Any, ...]:
    return cfg.get("voice"), cfg.get("ref_audio")


def _token_times_ms(ttft_s: float, itl_s: tuple[float, ...]) -> list[float]:
    """Each token's time since the append was accepted, in ms (first = TTFT)."""
    times, t = [], ttft_s
    if ttft_s <= 0:
        return times  # no token was decoded (an aborted or failed unit)
    for gap in (0.0, *itl_s):
        t += gap
        times.append(t * MS_PER_S)
    return times


def _dropped(index: int) -> StageOutput:
    return StageOutput({"type": "unit_done", "unit": index, "is_listen": True, "end_of_turn": False,
                        "aborted": True, "metrics": {}})
