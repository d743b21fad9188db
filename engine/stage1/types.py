"""Typed messages of the Stage1 (TTS) engine boundary: fences, unit requests, results, errors.

Plain frozen dataclasses (pydantic lives only at the wire). A request carries one speaking unit of one
session as handed off by Stage0 (model.md §3.7); a result carries that unit's codes (§5.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class Fence:
    """(incarnation, epoch) of a session (protocol.md §4.4); the session id travels beside it."""

    incarnation: int
    epoch: int


@dataclass(frozen=True, eq=False)
class TTSUnitRequest:
    """One speaking unit: n TTS rows (t_i, h_i, is_turn_eos_i) plus the turn flags (model.md §3.7).

    `hidden[i]` is the LLM final-norm state at the position where `text_ids[i]` itself was fed (§5.1).
    n may be 0 (Q11: the condition is then `audio_bos` only).
    """

    session_id: str
    fence: Fence
    unit_index: int
    text_ids: tuple[int, ...]
    hidden: torch.Tensor  # [n, llm_dim], any float dtype, any device
    is_turn_eos: tuple[bool, ...]
    end_of_turn: bool
    turn_start: bool
    # Set by the engine, never by a caller: this unit starts a fresh TTS context because the open turn would
    # pass `max_turn_positions` (model.md §5.2's cap; a turn closed by an override keeps its TTS KV, Q13).
    restart: bool = False

    @property
    def n_rows(self) -> int:
        return len(self.text_ids)


@dataclass(frozen=True, kw_only=True)  # keywords: a row of positional ints and flags says nothing
class TTSUnitResult:
    """The codes of one unit, in order; all of them are already in the session's TTS KV.

    `eos`: the unit stopped on EOS (codes before it are returned). `draws`: TTS-generator draws used
    (26 for a 25-code unit, e + 1 when EOS was drawn at step e). `start_pos` / `end_pos`: the turn
    positions before and after the unit; `turn_closed`: the KV was reset after this unit. `head`: how many
    of `codes` were already sent early as a `TTSHeadCodes` (0: none; `codes` is always the whole unit).
    """

    session_id: str
    fence: Fence
    unit_index: int
    codes: tuple[int, ...]
    eos: bool
    draws: int
    start_pos: int
    end_pos: int
    turn_closed: bool
    head: int = 0


@dataclass(frozen=True)
class TTSHeadCodes:
    """The first codes of a turn-start unit, sent while the unit is still running (`first_codes`).

    `codes` never holds EOS, so they are exactly the first `len(codes)` of the unit's `TTSUnitResult.codes`;
    `unit_codes`: the codes a full unit has (max_new_tokens - 1), so a consumer knows the most that follows.
    """

    session_id: str
    fence: Fence
    unit_index: int
    codes: tuple[int, ...]
    unit_codes: int


@dataclass(frozen=True)
class TTSCancelResult:
    """Terminal event of a cancel: the units dropped for this session (never another session's)."""

    session_id: str
    fence: Fence
    dropped_units: tuple[int, ...]
    noop: bool


class TTSError(Exception):
    """Base of every Stage1 engine error. Raising one never changes any session's state."""


class TTSRequestError(TTSError, ValueError):
    """A request is malformed; it was not queued."""


class UnknownSessionError(TTSError, KeyError):
    """No open session has this id."""


class SessionExistsError(TTSError):
    """`open` for a session id that is already open."""


class NoFreeSlotError(TTSError):
    """Every TTS KV slot is in use."""


class StaleFenceError(TTSError):
    """The fence's incarnation differs or its epoch is older than the session's (protocol.md F-1…F-3)."""


class HiddenDimError(TTSRequestError):
    """`hidden` is not a float tensor of shape [n, llm_dim]."""


class RowCountError(TTSRequestError):
    """`text_ids`, `hidden` rows and `is_turn_eos` disagree on n."""


class TokenIdError(TTSRequestError):
    """A text id is outside [0, num_text_tokens)."""


class BadSamplingError(TTSRequestError):
    """A talker temperature or repetition penalty the sampler cannot use (not finite and > 0)."""

    code = "bad_sampling"


class TurnCapacityError(TTSRequestError):
    """The unit would run the turn past `max_turn_positions` (the gateway closes the turn first)."""
