"""TTS bridge: one `tts_input` per append (TOKENS = text ids, HIDDEN = LLM states [n * llm_dim],
CONFIG = {"unit", "is_turn_eos", "end_of_turn", "turn_start"}) -> engine.stage1.TTSEngine -> one
`audio_tokens` event (TOKENS = the unit's codes), then FINAL.

With `engine_options.tts.first_codes` = K > 0, a unit that starts a TTS turn (every unit, with
`head_every_unit`) goes out in two parts, so
Token2Wav can start on it early (targets.md P7): `audio_tokens {"part": "head", "unit_codes"}` with its first
K codes as soon as they are sampled (`unit_codes`: the codes a full unit has), then `audio_tokens {"part":
"rest", "eos", "end_of_turn"}` with the others when the unit ends, then FINAL. A unit whose first K codes hold
EOS, and every other unit, is sent whole as above (no "part").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.loader import load_checkpoint
from engine.loader.checkpoint import TTS_COMPONENTS
from engine.stage1.config import TTSEngineConfig
from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import Fence, TTSHeadCodes, TTSUnitRequest, TTSUnitResult

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
from .options import check_config, seed_of, talker_sampling

# deploy profile `engine_options.tts` keys; max_turn_positions: the TTS KV slot per session (model.md §5.2; a
# longer turn goes on in a fresh TTS context), the engine default 8192 when absent; first_codes: a turn's first
# codes sent early (module docstring), 0 (off) when absent; gemm_tile_rows: every TTS GEMM on exactly that many
# rows, 0 (off) when absent (TTSEngineConfig); continuous: units join and leave between single-code steps
# (continuous batching, TTSEngineConfig.continuous), false when absent; head_every_unit: with first_codes, every
# unit's first codes sent early, not only a turn's first (TTSEngineConfig.head_every_unit), false when absent
OPTIONS = ("compile_step", "cuda_graphs", "max_turn_positions", "first_codes", "gemm_tile_rows", "continuous",
           "head_every_unit")


class TTSBridge(EngineBridge):
    def __init__(self, settings: StageSettings) -> None:
        super().__init__(settings)
        configure_torch(settings)
        opts = engine_options(settings, OPTIONS)
        turn = opts.get("max_turn_positions", TTSEngineConfig.max_turn_positions)
        if isinstance(turn, bool) or not isinstance(turn, int) or turn <= 0:  # before the checkpoint loads
            raise ConfigError(f"engine option max_turn_positions={turn!r} must be a positive integer")
        first, most = opts.get("first_codes", 0), TTSEngineConfig.max_new_tokens - 2
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= most:
            raise ConfigError(f"engine option first_codes={first!r} must be an integer in [0, {most}]")
        tile = count_option(opts, "tts", "gemm_tile_rows")  # checked before the weights load
        continuous = flag_option(opts, "tts", "continuous")
        every_unit = flag_option(opts, "tts", "head_every_unit")
        if every_unit and not first:
            raise ConfigError("engine option head_every_unit needs first_codes > 0 (the head's size)")
        ck = load_checkpoint(settings.checkpoint_dir, device=settings.device, dtype=torch_dtype(settings),
                             with_vision=False, with_token2wav=False, components=TTS_COMPONENTS)
        cfg = TTSEngineConfig(max_sessions=settings.max_sessions, max_batch=settings.max_sessions,
                              use_cuda_graphs=settings.device.startswith("cuda") and opts.get("cuda_graphs", True),
                              compile_step=bool(opts.get("compile_step", False)), max_turn_positions=turn,
                              first_codes=first, head_every_unit=every_unit, continuous=continuous, **tile)
        self.llm_dim = ck.config.tts.llm_dim
        self.engine = TTSEngine(ck.model.tts, cfg)  # the process holds only the TTS weights
        self.pending: dict[str, list[tuple[TTSUnitRequest, Any]]] = {}
        self._finished = 0  # engine.units_finished at the last sweep
        self.seeds: dict[str, int] = {}

    def warm_up(self, emit: Callable[[str], None]) -> None:
        """Every step / prefill graph (compiled first with `compile_step`) before the stage is ready."""
        self.engine.runner.warm_up(emit)

    def graph_misses(self) -> dict[str, int]:
        return self.engine.runner.misses.counts()

    def handle(self, req: StageRequest, sink: Any) -> None:
        sid, fence = session_key(req.corrid), Fence(req.fence[0], req.fence[1])
        if req.op == "open":
            sampling = self._sampling(req.config or {})
            self.seeds[sid] = seed_of(req.config or {})
            self.engine.open(sid, fence, self.seeds[sid], **sampling)
            self.pending[sid] = []
        elif req.op == "update":
            sampling = self._sampling(req.config or {})
            self._reseed(sid, fence, req.config or {})
            self.engine.set_sampling(sid, **sampling)
        elif req.op == "append":
            unit = self._unit(sid, fence, req)
            self.engine.submit(unit)
            self.pending.setdefault(sid, []).append((unit, sink))
            return  # the sink closes when the unit's codes are out
        elif req.op == "cancel":
            assert req.next_fence is not None
            self.engine.cancel(sid, fence, Fence(req.next_fence[0], req.next_fence[1]))
            self._sweep(sid)
        elif req.op == "close":
            self.engine.close(sid, fence)
            self._sweep(sid, everything=True)
            self.seeds.pop(sid, None)
        sink.emit(control_event(req, "tts"))
        sink.close()

    def _reseed(self, sid: str, fence: Fence, cfg: dict[str, Any]) -> None:
        """A new CONFIG seed before the session's first unit opens it again with that seed; later it is refused."""
        if cfg.get("seed") is None or seed_of(cfg) == self.seeds.get(sid):
            return
        session = self.engine.sessions.get(sid)
        if session is None or session.units_done or session.queue or self.pending.get(sid):
            raise RequestError("invalid_runtime_config", "CONFIG seed cannot change after the first unit")
        self.engine.close(sid, fence)
        self.seeds[sid] = seed_of(cfg)
        self.engine.open(sid, session.fence, self.seeds[sid], temperature=session.temperature,
                         repetition_penalty=session.repetition_penalty)

    def _sampling(self, cfg: dict[str, Any]) -> dict[str, float]:
        """The session's talker options (`options.talker_sampling`), after the whole CONFIG is checked."""
        check_config(cfg)
        return talker_sampling(cfg, codes_per_unit=self.engine.cfg.max_new_tokens - 1)  # the last sample is dropped

    def _unit(self, sid: str, fence: Fence, req: StageRequest) -> TTSUnitRequest:
        cfg = req.config or {}
        ids = req.tokens if req.tokens is not None else np.zeros(0, np.int64)
        hidden = req.hidden if req.hidden is not None else np.zeros(0, np.float32)
        if hidden.size != ids.size * self.llm_dim:
            raise RequestError("invalid_request", f"HIDDEN holds {hidden.size} values, expected "
                                                  f"{ids.size} rows x llm_dim {self.llm_dim}")
        flags = cfg.get("is_turn_eos") or [False] * ids.size
        return TTSUnitRequest(session_id=sid, fence=fence, unit_index=int(cfg.get("unit", 0)),
                              text_ids=tuple(int(t) for t in ids),
                              hidden=torch.from_numpy(hidden.reshape(ids.size, self.llm_dim).copy()),  # [n, llm_dim]
                              is_turn_eos=tuple(bool(f) for f in flags),
                              end_of_turn=bool(cfg.get("end_of_turn", False)),
                              turn_start=bool(cfg.get("turn_start", False)))

    def step(self) -> bool:
        results = self.engine.step(on_head=self._heads)
        self.step_rows = self.engine.rows_last_step
        for res in results:
            k = self._waiting(res.session_id, res.unit_index, res.fence)
            if k is not None:
                _, sink = self.pending[res.session_id].pop(k)
                sink.emit(self._codes(res))
                sink.close()
        if self.engine.units_finished != self._finished:  # a unit fenced off in flight ends without a result
            self._finished = self.engine.units_finished
            for sid in list(self.pending):
                self._sweep(sid)
        return bool(results) or self.engine.pending() > 0  # continuous: units still in flight

    def _heads(self, heads: list[TTSHeadCodes]) -> None:
        """A turn's first codes, sent while the engine step still runs; the request stays open for the rest."""
        for h in heads:
            k = self._waiting(h.session_id, h.unit_index, h.fence)
            if k is not None:
                self.pending[h.session_id][k][1].emit(StageOutput(
                    {"type": "audio_tokens", "unit": h.unit_index, "count": len(h.codes), "part": "head",
                     "unit_codes": h.unit_codes}, tokens=np.array(h.codes, dtype=np.int64)))

    def _waiting(self, sid: str, unit_index: int, fence: Fence) -> int | None:
        """Index of the unit's (request, sink) in `pending[sid]`, None when it has none."""
        for k, (unit, _) in enumerate(self.pending.get(sid, [])):
            if unit.unit_index == unit_index and unit.fence == fence:
                return k
        return None

    @staticmethod
    def _codes(res: TTSUnitResult) -> StageOutput:
        """The unit's codes: all of them, or the rest after a head already sent."""
        event = {"type": "audio_tokens", "unit": res.unit_index, "count": len(res.codes) - res.head,
                 "eos": res.eos, "end_of_turn": res.turn_closed}
        if res.head:
            event["part"] = "rest"
        return StageOutput(event, tokens=np.array(res.codes[res.head:], dtype=np.int64))

    def _sweep(self, sid: str, everything: bool = False) -> None:
        """End requests whose unit left the engine without a result (cancelled or fenced off)."""
        session = self.engine.sessions.get(sid)
        held = self.engine.holds(sid) if not everything else set()
        keep = []
        for unit, sink in self.pending.get(sid, []):
            if id(unit) in held:
                keep.append((unit, sink))
            else:
                sink.emit(StageOutput({"type": "audio_tokens", "unit": unit.unit_index, "count": 0,
                                       "dropped": True}, tokens=np.zeros(0, np.int64)))
                sink.close()
        if everything or session is None:
            self.pending.pop(sid, None)
        else:
            self.pending[sid] = keep

    def forget(self, corrid: int) -> None:
        sid = session_key(corrid)
        session = self.engine.sessions.get(sid)
        if session is not None:
            self.engine.close(sid, Fence(session.fence.incarnation, session.fence.epoch))
        self._sweep(sid, everything=True)
        self.seeds.pop(sid, None)

    def fail_all(self, out: StageOutput) -> None:
        for waiting in self.pending.values():
            for _, sink in waiting:
                sink.emit(out)
                sink.close()
            waiting.clear()
