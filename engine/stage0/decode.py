"""Decode rules for one unit (model.md §3.4, §3.7): a host-side state machine, no tensors.

The engine asks `needs_sample()` before a step (forced steps take no RNG draw), hands the sampled id to
`step()`, feeds the token when told to, and reports the fed token's hidden state back through `fed()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.stage0.config import DecodeRules, SpecialIds
from engine.stage0.detok import IncrementalText


@dataclass
class TurnState:
    """Session-long decode state (§3.1) that survives units."""

    current_turn_ended: bool = True
    units_generated: int = 0


@dataclass(frozen=True)
class Feed:
    token: int
    j: int


@dataclass(frozen=True)
class Stop:
    terminator: int
    rejected: int | None = None  # a token cut by the character cap (B6); not fed, still in the history


@dataclass
class TTSRow:
    token_id: int
    hidden: Any  # [H] tensor at the token's own position
    is_turn_eos: bool


@dataclass
class UnitDecoder:
    ids: SpecialIds
    rules: DecodeRules
    turn: TurnState
    detokenize: Callable[[list[int]], str]  # skips special tokens
    force_listen_override: bool = False
    j: int = 0
    is_listen: bool = False
    end_of_turn: bool = False
    terminator: int | None = None
    decision: int | None = None
    unit_ids: list[int] = field(default_factory=list)
    rows: list[TTSRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        # forced listen for the session's first units, or by the caller (A0)
        self.force = (self.turn.units_generated < self.rules.force_listen_count) or self.force_listen_override
        self.turn.units_generated += 1
        # A1 is decided now, before any step: an override while the turn is open feeds `<|turn_eos|>`
        self.close_turn_first = self.force_listen_override and not self.turn.current_turn_ended
        self._text = IncrementalText(self.detokenize)  # the text of `unit_ids`, one short decode per token

    def turn_closed(self) -> None:
        """A1 done: the `<|turn_eos|>` was fed (not a TTS row)."""
        self.turn.current_turn_ended = True
        self.close_turn_first = False

    @property
    def done(self) -> bool:
        return self.terminator is not None

    def needs_sample(self) -> bool:
        return not self.done and not self.force and self.j < self.rules.max_steps - 1

    def step(self, sampled: int | None) -> Feed | Stop:
        ids = self.ids
        if self.j == self.rules.max_steps - 1:  # the last step closes the unit unsampled (B1)
            return self._stop(ids.chunk_eos)
        if self.force:  # a forced unit listens without a draw (B2)
            t = ids.listen
        else:
            if sampled is None:
                raise ValueError("step() needs a sampled id when the step is not forced")
            t = sampled
            if t == ids.listen and not self.turn.current_turn_ended and self.rules.midturn_listen == "tts_bos":
                t = ids.tts_bos  # mid-turn listen becomes <|tts_bos|>, fed (B3, Q1)
        self.is_listen = t == ids.listen  # the unit is a listen unit iff this step's id is <|listen|> (B4)
        if self.j == 0:
            self.decision = t
        if t in ids.terminators:  # a terminator stops the unit, not fed yet (B5)
            return self._stop(t)
        self.turn.current_turn_ended = False  # a text token reopens the turn (B6)
        if self.j >= 1 and self.rules.max_speak_chars_per_unit > 0:
            if len(self._text.with_token(t)) >= self.rules.max_speak_chars_per_unit:
                return self._stop(ids.chunk_eos, rejected=t)
        return Feed(token=t, j=self.j)

    def fed(self, token: int, hidden: Any) -> TTSRow | None:
        """B7 after the forward: record the row (j ≥ 1) and move to the next step."""
        self.end_of_turn = token == self.ids.turn_eos
        if self.end_of_turn:
            self.turn.current_turn_ended = True
        row = None
        if self.j >= 1:
            row = TTSRow(token_id=token, hidden=hidden, is_turn_eos=self.end_of_turn)
            self.rows.append(row)
            self.unit_ids.append(token)
            self._text.push(token)
        self.j += 1
        return row

    def abort(self) -> Stop:
        """Cut the unit short (cancel): close on `<|listen|>` before any token, else `<|chunk_eos|>`."""
        return self._stop(self.ids.listen if self.j == 0 else self.ids.chunk_eos)

    def _stop(self, terminator: int, rejected: int | None = None) -> Stop:
        self.terminator = terminator
        return Stop(terminator=terminator, rejected=rejected)

    @property
    def text(self) -> str:
        return self._text.text
