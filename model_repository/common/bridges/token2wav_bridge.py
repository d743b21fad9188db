"""Token2Wav bridge: `audio_tokens` (TOKENS = one unit's codes, CONFIG = {"unit", "end_of_turn"}) ->
engine.stage1.Token2WavEngine -> `audio` events (AUDIO = 24 kHz PCM16) as chunks finish; the request
ends (FINAL) after the unit's last chunk. Voices are the checkpoint's voice packs, built once at load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.loader import load_checkpoint
from engine.stage1.token2wav_engine import Token2WavEngine, Token2WavEngineConfig
from engine.stage1.types import Fence
from engine.token2wav.buckets import row_buckets
from engine.token2wav.pool import PoolConfig

from ..codec import RequestError, StageOutput, StageRequest
from ..settings import ConfigError, StageSettings
from .base import (
    DTYPES,
    EngineBridge,
    configure_torch,
    control_event,
    engine_options,
    session_key,
    torch_dtype,
)
from .options import check_config, seed_of, voice_of

DEFAULT_VOICE = "default"
# Flow and HiFT rows are padded to row buckets (engine/token2wav/buckets.py: 7 at 32 sessions, 9 at 64), each
# with its own graphs (a warm-up turn builds ~5 shapes per bucket and kind); room for twice that before a
# shape runs eager (counted as a miss either way).
GRAPHS_PER_BUCKET = 10

OPTIONS = ("flow_dtype", "cuda_graphs")  # deploy profile `engine_options.token2wav` keys


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
        cuda = settings.device.startswith("cuda")
        cfg = Token2WavEngineConfig(max_batch=settings.max_sessions, use_cuda_graphs=cuda and opts.get("cuda_graphs", True),
                                    pool=PoolConfig(slots=settings.max_sessions),
                                    max_graphs=GRAPHS_PER_BUCKET * len(row_buckets(settings.max_sessions)))
        self.engine = Token2WavEngine(ck.token2wav, cfg)
        self.voices = ck.voices()
        if not self.voices:
            raise ConfigError(f"{ck.voices_dir}: the checkpoint has no voice packs")
        for voice_id in self.voices:
            self.engine.add_voice(voice_id, ck.voice(voice_id))
        self.default_voice = DEFAULT_VOICE if DEFAULT_VOICE in self.voices else sorted(self.voices)[0]
        self.pending: dict[str, list[tuple[int, Fence, Any, list[int]]]] = {}  # sid -> (unit, fence, sink, [seq])
        self.opened: dict[str, tuple[str, int, bool]] = {}  # sid -> (voice, seed, a unit was submitted)

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
            self.opened[sid] = (voice_of(cfg, self.voices, self.default_voice), seed_of(cfg), False)
            self.engine.open(sid, fence, *self.opened[sid][:2])
            self.pending[sid] = []
        elif req.op == "update":
            self._reseed(sid, cfg)
        elif req.op == "append":
            unit = int(cfg.get("unit", 0))
            codes = [] if req.tokens is None else [int(c) for c in req.tokens]
            self.engine.submit(sid, fence, unit, codes, bool(cfg.get("end_of_turn", False)))
            if sid in self.opened:
                self.opened[sid] = (*self.opened[sid][:2], True)  # the seed is in use from now on
            self.pending.setdefault(sid, []).append((unit, fence, sink, [0]))
            return  # the sink closes with the unit's last chunk
        elif req.op == "cancel":
            assert req.next_fence is not None
            result = self.engine.cancel(sid, fence, Fence(req.next_fence[0], req.next_fence[1]))
            self._end(sid, lambda u, f: u in result.dropped_units or f.epoch < req.next_fence[1])
        elif req.op == "close":
            self.engine.close(sid, fence)
            self._end(sid, lambda u, f: True)
            self.pending.pop(sid, None)
            self.opened.pop(sid, None)
        sink.emit(control_event(req, "token2wav"))
        sink.close()

    def _reseed(self, sid: str, cfg: dict[str, Any]) -> None:
        """A new CONFIG seed or voice before the session's first unit opens it again with them; later they are
        refused (the gateway locks both at the prefix commit)."""
        voice, seed, used = self.opened.get(sid, ("", None, True))
        new_voice = voice_of(cfg, self.voices, self.default_voice) if "voice" in cfg else voice  # absent: unchanged
        new_seed = seed if cfg.get("seed") is None else seed_of(cfg)
        if (new_voice, new_seed) == (voice, seed):
            return
        session = self.engine.sessions.get(sid)
        if used or session is None:
            raise RequestError("invalid_runtime_config", "CONFIG seed and voice cannot change after the first unit")
        self.engine.close(sid, session.fence)
        self.opened[sid] = (new_voice, new_seed, False)
        self.engine.open(sid, session.fence, new_voice, new_seed)

    def step(self) -> bool:
        # a row is one session's flow + vocoder call (queued silence is no row)
        self.step_rows = min(self.engine.cfg.max_batch, sum(
            1 for s in self.engine.sessions.values() if any(item.call is not None for item in s.queue)))
        chunks = self.engine.step()
        for chunk in chunks:
            waiting = self.pending.get(chunk.session_id, [])
            match = next((w for w in waiting if w[0] == chunk.unit_index and w[1] == chunk.fence), None)
            if match is None:
                continue
            unit, _, sink, seq = match
            if chunk.pcm.size:
                sink.emit(StageOutput({"type": "audio", "unit": unit, "seq": seq[0], "samples": int(chunk.pcm.size)},
                                      audio=chunk.pcm))
                seq[0] += 1
            if chunk.unit_final:
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
        self.opened.pop(sid, None)

    def fail_all(self, out: StageOutput) -> None:
        for waiting in self.pending.values():
            for item in waiting:
                item[2].emit(out)
                item[2].close()
            waiting.clear()
