"""Per-session Stage1 state (model.md §5.5) and the slot free-list for the TTS KV."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.sampling_draw import draw_uniforms, session_generator
from engine.stage1.types import Fence, NoFreeSlotError, TTSUnitRequest

# project convention (model.md §3.5.4): generators llm = seed, tts = seed + 1, vocoder = seed + 2
TTS_SEED_OFFSET = 1


class SlotTable:
    """Free-list of KV slot indices; the lowest free slot is handed out first."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots - 1, -1, -1))

    def acquire(self) -> int:
        if not self._free:
            raise NoFreeSlotError("every TTS KV slot is in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass
class TTSSession:
    """State one session owns in Stage1. `tts_pos` = KV length of the open turn (0: no open turn)."""

    session_id: str
    slot: int
    fence: Fence
    generator: torch.Generator
    temperature: float  # this session's talker sampling (model.md §5.4), per row in the batched sampler
    repetition_penalty: float
    tts_pos: int = 0
    queue: deque[TTSUnitRequest] = field(default_factory=deque)
    units_done: int = 0

    @classmethod
    def open(cls, session_id: str, slot: int, fence: Fence, seed: int, *, temperature: float,
             repetition_penalty: float) -> TTSSession:
        return cls(session_id=session_id, slot=slot, fence=fence, generator=session_generator(seed + TTS_SEED_OFFSET),
                   temperature=temperature, repetition_penalty=repetition_penalty)

    def take_uniforms(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(generator state before, `count` fp64 uniforms), without committing the draws.

        The unit may stop early on EOS; `commit_draws` then rewinds and advances by exactly the draws
        used, so the stream of draws equals one scalar draw per sampling step (§5.4 draw accounting).
        """
        state = self.generator.get_state()
        return state, draw_uniforms(self.generator, count)

    def commit_draws(self, state: torch.Tensor, used: int) -> None:
        self.generator.set_state(state)
        draw_uniforms(self.generator, used)

    def projected_end(self, rows: int, max_samples: int, *, restart: bool = False) -> int:
        """Worst-case turn position after the queued units and one more unit with `rows` rows (from 0 when
        that unit restarts the TTS context)."""
        pos = self.tts_pos
        for req in self.queue:
            start = 0 if req.restart else pos
            pos = 0 if req.end_of_turn else start + req.n_rows + 1 + max_samples
        return (0 if restart else pos) + rows + 1 + max_samples
