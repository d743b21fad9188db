"""The parts a Stage0 engine's request API (engine.py) and its step scheduler (loop.py) share (issue 19).

`SessionTable` is the one owner of the live sessions, their KV slots and the ids closed: the requests open
and close sessions through it, the step compacts its slots and closes a session whose prefix fails.
`PrefixEncoder` builds a session's system prefix, checked on `open` and rebuilt by the step for a new
prompt. Both sit below the engine and the scheduler, so neither imports the other's module.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from engine.stage0.config import Stage0Config, TextTokenizer
from engine.stage0.frontend import UnitFrontEnd
from engine.stage0.runner import ModelRunner
from engine.stage0.session import Session
from engine.stage0.slots import SlotTable
from engine.stage0.types import FrontEndError, SessionClosedError, UnknownSessionError


class SessionTable:
    def __init__(self, max_sessions: int) -> None:
        self.sessions: dict[str, Session] = {}
        self.slots = SlotTable(max_sessions)
        self.closed: set[str] = set()

    def add(self, s: Session) -> None:
        """`s` holds a slot from `slots.take()`; its id, once closed, is live again."""
        self.closed.discard(s.session_id)
        self.sessions[s.session_id] = s

    def remove(self, s: Session) -> None:
        """Close `s`: its slot is free, and later requests on its id get `session_closed`."""
        del self.sessions[s.session_id]
        self.slots.give(s.slot)
        self.closed.add(s.session_id)

    def live(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise (SessionClosedError if session_id in self.closed else UnknownSessionError)(session_id)
        return s

    def holds(self, s: Session) -> bool:
        """False once `s` was closed (by a request between the step's two locked parts, or by the step)."""
        return self.sessions.get(s.session_id) is s


class PrefixEncoder:
    """Builds system prefixes, keeping the last few: sessions of one deployment mostly share a prompt and a voice,
    and an open encodes its reference audio eagerly on the step thread (on the H200, stop 32's py-spy: about 16 ms
    an open, 0.8 s of step time while 48 sessions opened). The embeddings are a pure function of the prompt
    and the audio's samples; the cached tensor is shared read-only (the step only reads a session's prefix)."""

    CACHED = 8  # prefixes kept (each P x H in the model dtype: a few MB at full size)

    def __init__(self, tokenizer: TextTokenizer, frontend: UnitFrontEnd, runner: ModelRunner,
                 config: Stage0Config, hidden_size: int) -> None:
        self.tokenizer, self.frontend, self.runner = tokenizer, frontend, runner
        self.config, self.hidden_size = config, hidden_size
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def embeds(self, prompt: str, ref_audio: torch.Tensor | None) -> torch.Tensor:
        """The system prefix (prompt and reference-audio markers, model.md §3.2) → [P, H]."""
        key = (prompt, None if ref_audio is None else _digest(ref_audio))
        rows = self._cache.pop(key, None)
        if rows is None:
            rows = self._build(prompt, ref_audio)
        self._cache[key] = rows  # the most recently used last
        if len(self._cache) > self.CACHED:
            self._cache.popitem(last=False)
        return rows

    def _build(self, prompt: str, ref_audio: torch.Tensor | None) -> torch.Tensor:
        ref = None
        if ref_audio is not None:
            ref = self.frontend.encode_reference(ref_audio).to(self.runner.device, self.runner.dtype)
            if ref.dim() != 2 or ref.shape[1] != self.hidden_size:
                raise FrontEndError(f"reference audio embeddings have shape {tuple(ref.shape)}")
        if ref is None and not self.config.empty_ref_audio_markers:
            return self.runner.embed(self.tokenizer.encode(f"<|im_start|>system\n{prompt}<|im_end|>"))
        head = self.runner.embed(self.tokenizer.encode(f"<|im_start|>system\n{prompt}\n<|audio_start|>"))
        tail = self.runner.embed(self.tokenizer.encode("<|audio_end|><|im_end|>"))
        return torch.cat([head, *([ref] if ref is not None else []), tail])


def _digest(pcm: torch.Tensor) -> tuple:
    """The samples' identity: dtype, shape and a hash of the bytes (10 s of audio hash in well under a ms)."""
    data = pcm.detach().cpu().contiguous()
    return str(data.dtype), tuple(data.shape), hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(),
                                                               digest_size=16).digest()
