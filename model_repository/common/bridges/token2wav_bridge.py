"""Token2Wav bridge: `audio_tokens` (TOKENS = one unit's codes, CONFIG = {"unit", "end_of_turn"}) ->
engine.stage1.Token2WavEngine -> `audio` events (AUDIO = 24 kHz PCM16, `last` on the unit's last chunk) as
chunks finish; the request ends (FINAL) after the unit's last chunk. A unit may come in two requests, CONFIG
`"part": "head"` (its first codes, with `"unit_codes"`: the codes of the whole unit) then `"part": "rest"`: each
ends after its own last chunk, `last` still marks the unit's, and `seq` runs on across the two. Voices are the
checkpoint's voice packs, built once at load, and the clips of sessions opened with `ref_audio` (model.md §6.1):
a clip's voice pack is made by the checkpoint's S3 tokenizer and CAM++ (engine/token2wav/prompt.py) on a worker
thread, not the engine thread; the engine thread builds its base cache once, shared by every session with the
same clip (keyed by its hash) and dropped with the last of them. A checkpoint without the two ONNX models keeps
the session's named voice (logged once at load).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.loader import load_checkpoint
from engine.loader.checkpoint import TOKEN2WAV_DIR
from engine.stage1.token2wav_engine import Token2WavEngine, Token2WavEngineConfig
from engine.stage1.types import Fence
from engine.token2wav.buckets import row_buckets
from engine.token2wav.pool import PoolConfig
from engine.token2wav.prompt import PromptModels, load_prompt_models, voice_from_clip
from engine.voice import VoicePack

from ..codec import RequestError, StageOutput, StageRequest
from ..settings import ConfigError, StageSettings
from .base import (
    DTYPES,
    EngineBridge,
    configure_torch,
    control_event,
    engine_error,
    engine_options,
    flag_option,
    session_key,
    torch_dtype,
)
from .options import check_config, ref_audio, seed_of, voice_of

log = logging.getLogger(__name__)

DEFAULT_VOICE = "default"
CLIP_VOICE = "clip:"  # engine voice id prefix of a client clip: + sha256 of its CONFIG `ref_audio` string
MAX_CLIP_PACKS = 64  # clip voice packs kept for reuse (each a few hundred KiB; the base caches are not kept)
# Flow and HiFT rows are padded to row buckets (engine/token2wav/buckets.py: 7 at 32 sessions, 9 at 64), each
# with its own graphs (a warm-up turn builds ~5 shapes per bucket and kind); room for twice that before a
# shape runs eager (counted as a miss either way).
GRAPHS_PER_BUCKET = 10
HEAD_GRAPHS = 2  # with heads: a head's and a rest's vocoder shapes more per row bucket
MID_TURN_HEAD_GRAPHS = 1  # with heads in every unit: a mid-turn head's vocoder shape (its mel cache leads it)

# deploy profile `engine_options.token2wav` keys; head_codes: the TTS's first_codes, which the model repository
# builder copies here (build/make_model_repository.py), so warm-up builds the head's and rest's call shapes;
# head_every_unit: the TTS's, copied the same way (heads render in any unit of a turn), false when absent;
# compile_flow / compile_hift: the flow's conformer and DiT blocks / the HiFT's Snake activations torch.compile'd
# before graph capture (Token2WavEngineConfig), false when absent; tile_rows: every flow and HiFT batch on exactly
# that many rows (a session's PCM the same bits whatever shares its batch), 0 when absent
OPTIONS = ("flow_dtype", "cuda_graphs", "head_codes", "head_every_unit", "compile_flow", "compile_hift", "tile_rows")


class Token2WavBridge(EngineBridge):
    def __init__(self, settings: StageSettings) -> None:
        super().__init__(settings)
        configure_torch(settings)
        opts = engine_options(settings, OPTIONS)
        flow_dtype = DTYPES.get(opts.get("flow_dtype", "float32"))
        if flow_dtype is None:
            raise ConfigError(f"engine option flow_dtype={opts['flow_dtype']!r} must be one of {sorted(DTYPES)}")
        ck = load_checkpoint(settings.checkpoint_dir, device=settings.device, dtype=torch_dtype(settings),
                             with_vision=False, flow_dtype=flow_dtype, components=())  # Token2Wav assets only
        if ck.token2wav is None:
            raise ConfigError(f"{settings.checkpoint_dir}: no Token2Wav assets")
        head = opts.get("head_codes", 0)
        if isinstance(head, bool) or not isinstance(head, int) or head < 0:
            raise ConfigError(f"engine option head_codes={head!r} must be an integer >= 0")
        tile = opts.get("tile_rows", 0)
        if isinstance(tile, bool) or not isinstance(tile, int) or not 0 <= tile <= settings.max_sessions:
            raise ConfigError(f"engine option tile_rows={tile!r} must be an integer 0..max_sessions "
                              f"({settings.max_sessions})")
        every_unit = flag_option(opts, "token2wav", "head_every_unit")
        if every_unit and not head:
            raise ConfigError("engine option head_every_unit needs head_codes > 0")
        compiled = {name: flag_option(opts, "token2wav", name) for name in ("compile_flow", "compile_hift")}
        cuda = settings.device.startswith("cuda")
        per_bucket = GRAPHS_PER_BUCKET + (HEAD_GRAPHS if head else 0) + (MID_TURN_HEAD_GRAPHS if every_unit else 0)
        cfg = Token2WavEngineConfig(max_batch=settings.max_sessions, use_cuda_graphs=cuda and opts.get("cuda_graphs", True),
                                    pool=PoolConfig(slots=settings.max_sessions), head_codes=head,
                                    head_every_unit=every_unit, **compiled,
                                    tile_rows=tile,
                                    max_graphs=per_bucket * len(row_buckets(settings.max_sessions)))
        self.engine = Token2WavEngine(ck.token2wav, cfg)
        self.voices = ck.voices()
        if not self.voices:
            raise ConfigError(f"{ck.voices_dir}: the checkpoint has no voice packs")
        for voice_id in self.voices:
            self.engine.add_voice(voice_id, ck.voice(voice_id))
        self.default_voice = DEFAULT_VOICE if DEFAULT_VOICE in self.voices else sorted(self.voices)[0]
        self.pending: dict[str, list[tuple[int, Fence, Any, list[int]]]] = {}  # sid -> (unit, fence, sink, [seq])
        # sid -> (unit, fence) -> [next seq]: shared by a unit's head and rest requests, dropped with its last chunk
        self.seqs: dict[str, dict[tuple[int, Fence], list[int]]] = {}
        self.opened: dict[str, tuple[str, int, bool]] = {}  # sid -> (voice, seed, a unit was submitted)
        self.prompt_models, why = load_prompt_models(ck.path / TOKEN2WAV_DIR)
        if self.prompt_models is None:
            log.warning("no speech tokenizer / campplus (%s): ref_audio does not change the vocoder voice", why)
        self.packs = _ClipPacks(self.prompt_models, self.engine.cfg.pool.max_prompt_frames)
        # Requests of a session whose clip is being made wait behind it on this one worker (order kept).
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="token2wav-voice")
        self._building: dict[int, int] = {}  # corrid -> its requests on the worker
        self._building_lock = threading.Lock()

    # ---- adapter thread: a new clip's voice pack is made on the worker, off the engine thread ----------
    def submit(self, req: StageRequest, sink: Any) -> None:
        clip = self.packs.wanted(req)
        if not self._behind_worker(req.corrid, clip is not None):
            super().submit(req, sink)
            return
        self._builder.submit(self._prepare, req, sink, clip)

    def drop(self, corrid: int) -> None:
        if not self._behind_worker(corrid, False):
            super().drop(corrid)
            return
        self._builder.submit(self._in_order, corrid, lambda: super(Token2WavBridge, self).drop(corrid))

    def _behind_worker(self, corrid: int, building: bool) -> bool:
        """True (and counted) when this request must queue on the worker: it makes a clip, or an earlier
        request of its session still waits there."""
        with self._building_lock:
            waiting = self._building.get(corrid, 0)
            if not building and not waiting:
                return False
            self._building[corrid] = waiting + 1
            return True

    def _prepare(self, req: StageRequest, sink: Any, clip: str | None) -> None:
        def make_then_queue() -> None:
            try:
                if clip is not None:
                    self.packs.make(clip)
                super(Token2WavBridge, self).submit(req, sink)
            except Exception as exc:  # noqa: BLE001 - a bad clip fails its own request only
                sink.emit(engine_error(exc))
                sink.close()

        self._in_order(req.corrid, make_then_queue)

    def _in_order(self, corrid: int, work: Callable[[], None]) -> None:
        try:
            work()
        finally:
            with self._building_lock:
                left = self._building.pop(corrid) - 1
                if left:
                    self._building[corrid] = left

    def stop(self) -> None:
        self._builder.shutdown(wait=True)
        super().stop()

    def warm_up(self, emit: Callable[[str], None]) -> None:
        """Every row bucket's graphs, by synthetic turns in the default voice, before the stage is ready."""
        self.engine.warm_up(self.default_voice, emit)

    def graph_misses(self) -> dict[str, int]:
        return self.engine.misses.counts()

    def handle(self, req: StageRequest, sink: Any) -> None:
        sid, fence = session_key(req.corrid), Fence(req.fence[0], req.fence[1])
        cfg = req.config or {}
        if req.op in ("open", "update"):
            check_config(cfg)
        if req.op == "open":
            self._open(sid, fence, self._voice(cfg), seed_of(cfg))
            self.pending[sid] = []
        elif req.op == "update":
            self._reseed(sid, cfg)
        elif req.op == "append":
            unit = int(cfg.get("unit", 0))
            part, unit_codes = _unit_part(cfg)
            codes = [] if req.tokens is None else [int(c) for c in req.tokens]
            self.engine.submit(sid, fence, unit, codes, bool(cfg.get("end_of_turn", False)), part, unit_codes)
            if sid in self.opened:
                self.opened[sid] = (*self.opened[sid][:2], True)  # the seed is in use from now on
            seq = self.seqs.setdefault(sid, {}).setdefault((unit, fence), [0])
            self.pending.setdefault(sid, []).append((unit, fence, sink, seq))
            return  # the sink closes with this request's last chunk (a head's, or the unit's)
        elif req.op == "cancel":
            assert req.next_fence is not None
            result = self.engine.cancel(sid, fence, Fence(req.next_fence[0], req.next_fence[1]))
            self._end(sid, lambda u, f: u in result.dropped_units or f.epoch < req.next_fence[1])
            kept = self.seqs.get(sid, {}).items()
            self.seqs[sid] = {(u, f): n for (u, f), n in kept if f.epoch >= req.next_fence[1]}
        elif req.op == "close":
            if self.engine.close(sid, fence):
                self._release(self.opened.pop(sid, ("",))[0])
            self._end(sid, lambda u, f: True)
            self.pending.pop(sid, None)
            self.seqs.pop(sid, None)
        sink.emit(control_event(req, "token2wav"))
        sink.close()

    def _reseed(self, sid: str, cfg: dict[str, Any]) -> None:
        """A new CONFIG seed, voice or clip before the session's first unit opens it again with them; later
        they are refused (the gateway locks them at the prefix commit)."""
        voice, seed, used = self.opened.get(sid, ("", None, True))
        # absent: unchanged (as stage0: a `voice` without `ref_audio` means no clip)
        new_voice = self._voice(cfg) if "voice" in cfg or "ref_audio" in cfg else voice
        new_seed = seed if cfg.get("seed") is None else seed_of(cfg)
        if (new_voice, new_seed) == (voice, seed):
            return
        session = self.engine.sessions.get(sid)
        if used or session is None:
            self._release(new_voice)
            raise RequestError("invalid_runtime_config",
                               "CONFIG seed, voice and ref_audio cannot change after the first unit")
        self.engine.close(sid, session.fence)
        self.opened.pop(sid)
        try:
            self._open(sid, session.fence, new_voice, new_seed)
        finally:
            self._release(voice)  # after the new open: a reseed in the same clip voice keeps its cache

    # ---- voices (engine thread) -----------------------------------------------------------------------
    def _voice(self, cfg: dict[str, Any]) -> str:
        """The engine voice of a CONFIG: its clip's (added now if new), else its named voice."""
        named = voice_of(cfg, self.voices, self.default_voice)
        encoded = cfg.get("ref_audio")
        if not isinstance(encoded, str) or self.prompt_models is None:
            ref_audio(cfg)  # checks the encoding even where the clip cannot change the voice
            return named
        voice_id = CLIP_VOICE + _clip_key(encoded)
        if voice_id not in self.engine.voices:
            self.engine.add_voice(voice_id, self.packs.make(encoded))  # decodes (and checks) the clip
        return voice_id

    def _open(self, sid: str, fence: Fence, voice: str, seed: int) -> None:
        try:
            self.engine.open(sid, fence, voice, seed)
        except Exception:
            self._release(voice)
            raise
        self.opened[sid] = (voice, seed, False)

    def _release(self, voice: str) -> None:
        """Drop a clip's base cache once no open session uses it (an open stream keeps its own reference)."""
        if voice.startswith(CLIP_VOICE) and all(v != voice for v, *_ in self.opened.values()):
            self.engine.voices.pop(voice, None)

    def step(self) -> bool:
        # a row is one session's flow + vocoder call (queued silence is no row)
        self.step_rows = min(self.engine.cfg.max_batch, sum(
            1 for s in self.engine.sessions.values() if any(item.call is not None for item in s.queue)))
        chunks = self.engine.step()
        for chunk in chunks:
            waiting = self.pending.get(chunk.session_id, [])
            # a unit's head request is queued (and served) before its rest's: the first match is the live one
            match = next((w for w in waiting if w[0] == chunk.unit_index and w[1] == chunk.fence), None)
            if chunk.unit_final:
                self.seqs.get(chunk.session_id, {}).pop((chunk.unit_index, chunk.fence), None)
            if match is None:
                continue
            unit, _, sink, seq = match
            if chunk.pcm.size:
                # `last`: the gateway sends a piece that is not its unit's last at once, without its UnitDone
                sink.emit(StageOutput({"type": "audio", "unit": unit, "seq": seq[0], "samples": int(chunk.pcm.size),
                                       "last": bool(chunk.unit_final)}, audio=chunk.pcm))
                seq[0] += 1
            if chunk.part_final:
                waiting.remove(match)
                sink.close()
        return bool(chunks) or self.engine.pending() > 0

    def _end(self, sid: str, dropped: Any) -> None:
        keep = []
        for item in self.pending.get(sid, []):
            if dropped(item[0], item[1]):
                item[2].close()
            else:
                keep.append(item)
        self.pending[sid] = keep

    def forget(self, corrid: int) -> None:
        sid = session_key(corrid)
        s = self.engine.sessions.get(sid)
        if s is not None:
            self.engine.close(sid, s.fence)
        self._end(sid, lambda u, f: True)
        self.pending.pop(sid, None)
        self.seqs.pop(sid, None)
        self._release(self.opened.pop(sid, ("",))[0])

    def fail_all(self, out: StageOutput) -> None:
        for waiting in self.pending.values():
            for item in waiting:
                item[2].emit(out)
                item[2].close()
            waiting.clear()


def _unit_part(cfg: dict[str, Any]) -> tuple[str | None, int | None]:
    """An append CONFIG's `part` (None: a whole unit) and `unit_codes` (the codes of the whole unit)."""
    part, unit_codes = cfg.get("part"), cfg.get("unit_codes")
    if part not in (None, "head", "rest"):
        raise RequestError("invalid_request", f"CONFIG part={part!r} must be \"head\" or \"rest\"")
    if unit_codes is not None and (isinstance(unit_codes, bool) or not isinstance(unit_codes, int) or unit_codes < 1):
        raise RequestError("invalid_request", f"CONFIG unit_codes={unit_codes!r} must be a positive integer")
    return part, unit_codes


def _clip_key(encoded: str) -> str:
    return hashlib.sha256(encoded.encode()).hexdigest()


class _ClipPacks:
    """Voice packs of client clips by clip hash, most recent `MAX_CLIP_PACKS`; made on the worker (or, for a
    pack evicted meanwhile, on the engine thread). Both threads use it, under its lock."""

    def __init__(self, models: PromptModels | None, max_prompt_frames: int) -> None:
        self.models, self.max_prompt_frames = models, max_prompt_frames
        self._packs: OrderedDict[str, VoicePack] = OrderedDict()
        self._lock = threading.Lock()

    def wanted(self, req: StageRequest) -> str | None:
        """The CONFIG `ref_audio` of an open/update whose pack is still to make, else None."""
        encoded = (req.config or {}).get("ref_audio") if req.op in ("open", "update") else None
        if self.models is None or not isinstance(encoded, str):
            return None
        with self._lock:
            return None if _clip_key(encoded) in self._packs else encoded

    def make(self, encoded: str) -> VoicePack:
        key = _clip_key(encoded)
        with self._lock:
            if key in self._packs:
                self._packs.move_to_end(key)
                return self._packs[key]
        assert self.models is not None
        clip = ref_audio({"ref_audio": encoded})
        assert clip is not None
        pack = voice_from_clip(self.models, clip, voice_id=CLIP_VOICE + key, max_prompt_frames=self.max_prompt_frames)
        with self._lock:
            self._packs[key] = pack
            while len(self._packs) > MAX_CLIP_PACKS:
                self._packs.popitem(last=False)
        return pack
