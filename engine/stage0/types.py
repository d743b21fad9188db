"""Stage0's closed message set: fences, typed errors, output events, metrics (model.md §3.7)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class Fence:
    """(incarnation, epoch), ordered lexicographically; `seq` orders appends within an epoch."""

    incarnation: int
    epoch: int
    seq: int = field(default=0, compare=False)


class Stage0Error(Exception):
    """Base of every error the engine raises for a bad request. The engine state is unchanged."""

    code = "stage0_error"


class UnknownSessionError(Stage0Error):
    code = "unknown_session"


class SessionClosedError(Stage0Error):
    code = "session_closed"


class SessionExistsError(Stage0Error):
    code = "session_exists"


class StaleFenceError(Stage0Error):
    """An append or update carrying a dead epoch, another incarnation, or a replayed seq."""

    code = "stale_fence"


class InvalidFenceError(Stage0Error):
    """A cancel whose next fence is not (same incarnation, epoch + 1), or a fence from the future."""

    code = "invalid_fence"


class BadAudioError(Stage0Error):
    code = "bad_audio"


class TooManyFramesError(Stage0Error):
    code = "too_many_frames"


class CapacityError(Stage0Error):
    """No free session slot, or a unit that could not fit in the session's KV."""

    code = "capacity"


class BadSamplingError(Stage0Error):
    """A per-unit sampling override the sampler cannot use (e.g. a negative temperature)."""

    code = "bad_sampling"


class FrontEndError(Stage0Error):
    """The audio/vision front end is missing a capability or returned a bad shape."""

    code = "front_end"


class BadFrameError(Stage0Error):
    """A camera frame that is not a decodable JPEG/PNG image."""

    code = "bad_frame"


# The event records below are keyword-only: a row of positional booleans (`..., False, True, ...`) cannot say
# which flag is which, and a field added in the middle would shift every caller silently.
@dataclass(frozen=True, kw_only=True)
class UnitMetrics:
    queue_s: float  # append accepted → unit prefill scheduled
    ttft_s: float  # append accepted → decision token
    tpot_s: float  # mean inter-token latency after the decision (0 when there is none)
    itl_s: tuple[float, ...]
    tokens: int  # decode-loop tokens, decision and terminator included


@dataclass(frozen=True, kw_only=True)
class TokenEvent:
    """One decode-loop result as soon as it is produced. `hidden` [H] is None for an unfed decision."""

    session_id: str
    fence: Fence
    unit_index: int
    j: int
    token_id: int
    text: str  # new characters of the unit text (special tokens skipped)
    hidden: Any
    end_of_turn: bool
    is_tts_row: bool
    decision: bool
    # on the decision event (j = 0): the engine's own verdict (B4: the token is `<|listen|>`) and whether the
    # unit was forced to listen (force_listen_count or an override), so no reader has to recompute either
    listen: bool = False
    forced: bool = False
    sampled_at: float = 0.0  # time.monotonic() when the token was sampled (0.0: not a sampled token)


@dataclass(frozen=True, kw_only=True)
class UnitDone:
    """The unit's outcome and Stage1 hand-off (§3.7). Terminal event of every unit, also an aborted one."""

    session_id: str
    fence: Fence
    unit_index: int
    is_listen: bool
    terminator: int
    rows: tuple[Any, ...]  # TTSRow(token_id, hidden, is_turn_eos); empty on listen units
    text: str
    end_of_turn: bool
    aborted: bool
    metrics: UnitMetrics
    error: str | None = None  # the unit failed; the KV is as it was before the unit (nothing of it was kept)
    error_code: str = "bad_audio"  # `bad_audio` (its audio/frames could not be encoded) or `internal_error`
    forced: bool = False  # the unit was forced to listen (the decoder's A0/override verdict)


Event = TokenEvent | UnitDone
