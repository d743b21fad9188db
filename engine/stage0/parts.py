"""The parts of a Stage0 engine that its request API and its step loop share (issue 19: no import cycle).

`Stage0Engine.__init__` (engine.py) builds them; the step (loop.py) and its recovery (recovery.py) use them.
Declaring them here, below all three, lets the loop's files name what they touch without importing the
engine class that is built on top of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from engine.model.llm import Qwen3LLM
from engine.stage0.audio_worker import AudioWorker
from engine.stage0.config import DecodeRules, SpecialIds, Stage0Config, TextTokenizer
from engine.stage0.frontend import UnitFrontEnd
from engine.stage0.penalty import HistoryRing
from engine.stage0.runner import ModelRunner
from engine.stage0.sampling import SamplerIds
from engine.stage0.script import DecisionScript
from engine.stage0.session import Session
from engine.stage0.slots import SlotTable
from engine.stage0.types import Event, FrontEndError


class EngineParts:
    model: Qwen3LLM
    tokenizer: TextTokenizer
    frontend: UnitFrontEnd
    on_event: Callable[[Event], None]
    config: Stage0Config
    rules: DecodeRules
    ids: SpecialIds
    sampler_ids: SamplerIds
    runner: ModelRunner
    history_ring: HistoryRing
    script: DecisionScript | None
    slots: SlotTable
    sessions: dict[str, Session]
    closed: set[str]
    lock: threading.RLock
    wake: threading.Event  # set by every request so an idle `serve()` loop steps at once
    audio_worker: AudioWorker | None  # the front end on its own thread (`start_audio_worker`), else in the step
    last_rows: int  # rows the last step fed (batch occupancy)

    def _emit(self, event: Event) -> None:
        self.on_event(event)

    def _prefix_embeds(self, prompt: str, ref_audio: torch.Tensor | None) -> torch.Tensor:
        """System prefix (§3.2) → [P, H]."""
        ref = None
        if ref_audio is not None:
            ref = self.frontend.encode_reference(ref_audio).to(self.runner.device, self.runner.dtype)
            if ref.dim() != 2 or ref.shape[1] != self.model.cfg.hidden_size:
                raise FrontEndError(f"reference audio embeddings have shape {tuple(ref.shape)}")
        if ref is None and not self.config.empty_ref_audio_markers:
            return self.runner.embed(self.tokenizer.encode(f"<|im_start|>system\n{prompt}<|im_end|>"))
        head = self.runner.embed(self.tokenizer.encode(f"<|im_start|>system\n{prompt}\n<|audio_start|>"))
        tail = self.runner.embed(self.tokenizer.encode("<|audio_end|><|im_end|>"))
        return torch.cat([head, *([ref] if ref is not None else []), tail])
