"""Per-session Stage0 state (model.md §3.1): slot, KV length, unit ledger, fences, queued units, work."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, overload

import torch

from engine.stage0.config import DecodeRules
from engine.stage0.decode import TurnState, UnitDecoder
from engine.stage0.penalty import MAX_REPETITION_WINDOW
from engine.stage0.sampling import SamplingParams, UniformStream
from engine.stage0.types import Fence, UnitMetrics


class DrawHistory:
    """A session's Step-B draws (the reference's `generated_history`), indexed from the session's first draw.

    Its length counts every draw ever made; only the latest ones are stored (at least MAX_REPETITION_WINDOW, the
    longest window a penalty may look back over), so an hour-long session does not grow it without bound
    (bench/kv_growth.py: 13,144 draws in one hour before this). Reading a dropped draw is an error.
    """

    __slots__ = ("_base", "_ids")

    def __init__(self, ids: list[int] | None = None) -> None:
        self._ids: list[int] = list(ids or [])
        self._base = 0  # draws dropped from the front

    def __len__(self) -> int:
        return self._base + len(self._ids)

    def __iter__(self) -> Iterator[int]:
        """The stored draws (all of them until the first trim)."""
        return iter(self._ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DrawHistory):
            return (self._base, self._ids) == (other._base, other._ids)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if start < self._base and start < stop:
                raise IndexError(f"draw {start} was dropped (the history keeps draws from {self._base})")
            return self._ids[start - self._base:stop - self._base:step]
        n = i + len(self) if i < 0 else i
        if not self._base <= n < len(self):
            raise IndexError(f"draw {i} is not kept (draws {self._base}..{len(self) - 1} are)")
        return self._ids[n - self._base]

    def append(self, token: int) -> None:
        self._ids.append(token)
        if len(self._ids) >= 2 * MAX_REPETITION_WINDOW:  # amortised: one trim per MAX_REPETITION_WINDOW draws
            drop = len(self._ids) - MAX_REPETITION_WINDOW
            del self._ids[:drop]
            self._base += drop

    def truncate(self, length: int) -> None:
        """Back to the first `length` draws (a failed unit's rollback; never before the kept ones)."""
        if length < self._base:
            raise IndexError(f"cannot roll back to draw {length}: draws before {self._base} were dropped")
        del self._ids[length - self._base:]


@dataclass
class UnitJob:
    fence: Fence
    index: int  # unit index in the session's audio stream (0 carries the longer first unit)
    pcm: torch.Tensor
    frames: tuple[Any, ...]
    force_listen_override: bool
    # per-unit thinker temperature (a response-scoped option, protocol.md §2.8); None = the session's.
    # Resolved against the session's params when the unit starts, so an update queued before it still applies.
    temperature: float | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class UnitRecord:
    """Ledger entry (§3.1): KV span from `<unit>` through `</unit>`, and what the unit produced."""

    index: int
    span: int
    ids: tuple[int, ...]
    text: str
    is_listen: bool


class Phase(Enum):
    IDLE = "idle"  # no unit in flight
    PREFIX = "prefix"  # system prefix to feed
    PREFILL = "prefill"  # `<unit>` + frames + audio to feed (needs logits)
    TURN_EOS = "turn_eos"  # A1 `<|turn_eos|>` to feed (needs logits)
    FEED = "feed"  # a decoded token to feed (needs logits)
    CLOSE = "close"  # `[terminator, </unit>]` to feed


@dataclass
class UnitRun:
    """The unit in flight."""

    job: UnitJob
    index: int
    start_len: int  # KV length before `<unit>`
    started_at: float
    params: SamplingParams  # what this unit samples with: the session's, or its own temperature override
    decoder: UnitDecoder | None = None
    pending_token: int | None = None
    terminator: int | None = None
    aborted: bool = False
    token_times: list[float] = field(default_factory=list)
    # what a failed step restores (the unit is dropped from the KV as if it had never started)
    turn_before: TurnState = field(default_factory=TurnState)
    history_len: int = 0
    frame_embeds: list[torch.Tensor] | None = None  # [64, H] per frame, encoded with the step's other frames
    # [10, H] from the step's batched audio front end; the exception if that batch failed (the unit fails)
    audio_embeds: torch.Tensor | Exception | None = None
    audio_submitted: bool = False  # handed to the audio worker, which sets `audio_embeds` (audio_worker.py)

    def metrics(self) -> UnitMetrics:
        t = self.token_times
        itl = tuple(b - a for a, b in zip(t, t[1:], strict=False))
        return UnitMetrics(queue_s=self.started_at - self.job.enqueued_at,
                           ttft_s=(t[0] - self.job.enqueued_at) if t else 0.0,
                           tpot_s=sum(itl) / len(itl) if itl else 0.0, itl_s=itl, tokens=len(t))


@dataclass
class Session:
    session_id: str
    slot: int
    rules: DecodeRules
    fence: Fence  # current (incarnation, epoch); seq = last accepted append seq
    params: SamplingParams
    prompt: str
    ref_audio: torch.Tensor | None
    frontend_state: Any
    stream: UniformStream
    turn: TurnState = field(default_factory=TurnState)
    cached_len: int = 0
    prefix_len: int = 0
    ledger: list[UnitRecord] = field(default_factory=list)
    history: DrawHistory = field(default_factory=DrawHistory)  # generated_history: Step-B draws
    queue: deque[UnitJob] = field(default_factory=deque)
    phase: Phase = Phase.PREFIX
    unit: UnitRun | None = None
    appended: int = 0  # accepted appends (unit index of the next one)
    last_seq: int = -1
    text_sent: str = ""
    pending_params: SamplingParams | None = None
    pending_prompt: str | None = None
    override_next: bool = False  # F-5: a cancel that found the turn open forces listen + `<|turn_eos|>`
    prefix_rows: torch.Tensor | None = None  # [P, H] embeddings of the system prefix to feed
    # `merge_unit_close`: the last unit's `[terminator, </unit>]`, owed to the KV until the next prefill
    pending_close: tuple[int, ...] = ()

    @property
    def unit_params(self) -> SamplingParams:
        """What the unit in flight samples with (its own temperature override, if any), else the session's."""
        return self.unit.params if self.unit is not None else self.params

    def ledger_total(self) -> int:
        return sum(r.span for r in self.ledger)

    @property
    def owed_len(self) -> int:
        """The cache length once an owed (merged) close is fed."""
        return self.cached_len + len(self.pending_close)

    def prefix_to_feed(self) -> int:
        """Positions of the system prefix not yet in the KV (it is fed in chunks, `Stage0Config.prefix_chunk`)."""
        if self.prefix_rows is None:
            return 0
        return self.prefix_rows.shape[0] - (self.cached_len if self.phase is Phase.PREFIX else 0)

    def check_accounting(self) -> None:
        """I12: ledger spans sum to the cache length (with an owed close) minus the prefix whenever no unit
        is in flight."""
        if self.unit is None and self.phase is Phase.IDLE:
            assert self.ledger_total() == self.owed_len - self.prefix_len, (self.session_id,)
