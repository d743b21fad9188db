"""The gateway's view of the runtime (protocol.md §4.4, notes/triton_contract.md).

One closed set of typed messages for this boundary: fenced operations go out through `Runtime`,
runtime events come back through `Runtime.events(key)` as the `RuntimeEvent` union. Each event
carries the fence epoch of the request that produced it, so the session can reject stale output at
acceptance (§3.9) without trusting the runtime to have filtered it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass(frozen=True, slots=True)
class Fence:
    incarnation: int
    epoch: int
    append_seq: int = 0

    def next(self) -> Fence:
        return Fence(self.incarnation, self.epoch + 1, self.append_seq)


@dataclass(frozen=True, slots=True)
class SessionKey:
    session_id: str
    correlation_id: int  # Triton sequence id: random non-zero 63-bit integer per (session, incarnation)


@dataclass(frozen=True, slots=True)
class UnitSubmission:
    unit_index: int
    pcm: bytes  # float32 LE, 16 kHz mono; 16,480 samples for unit 0, 16,000 after
    frames: tuple[bytes, ...] = ()
    force_listen: bool = False
    synthetic: bool = False  # silence continuation (§8.6 U-3), for accounting only
    # thinker temperature of the response owning this unit (§2.8) when it differs from the session's; None = the
    # session's. Travels as the append's CONFIG {"thinker": {"temperature": t}} and applies to this unit only.
    temperature: float | None = None


# The runtime events are keyword-only: `UnitDone(0, 7, False, True, ...)` cannot say which flag is which.
@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    epoch: int
    unit: int
    action: Literal["listen", "speak"]
    forced: bool = False
    kind: Literal["decision"] = "decision"


@dataclass(frozen=True, slots=True, kw_only=True)
class TextPiece:
    epoch: int
    unit: int
    text: str
    token_id: int | None = None
    # time.monotonic() stamps of the text's way out (P13): when the engine sampled the token (stage0's wire field
    # `sampled_at`; comparable only on the engine's host, see `text_started_at`) and when the gateway's runtime
    # client received it. None where nobody stamped it.
    sampled_at: float | None = None
    received_at: float | None = None
    kind: Literal["text"] = "text"


@dataclass(frozen=True, slots=True, kw_only=True)
class AudioPiece:
    epoch: int
    unit: int
    seq: int
    pcm16: bytes  # 24 kHz mono PCM16 LE
    # Token2Wav's `last` flag: False for a piece that is not its unit's last (the session sends it at once),
    # True for the last; None where the runtime does not say (the piece waits for the unit's UnitDone).
    last: bool | None = None
    kind: Literal["audio"] = "audio"


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitDone:
    epoch: int
    unit: int
    is_listen: bool
    end_of_turn: bool
    metrics: Mapping[str, Any] = field(default_factory=dict)
    forced: bool = False
    kind: Literal["unit_done"] = "unit_done"


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamError:
    """An `error` EVENT that is not tied to one awaited operation (e.g. a broken output stream)."""
    epoch: int
    code: str
    message: str
    kind: Literal["error"] = "error"


RuntimeEvent = Decision | TextPiece | AudioPiece | UnitDone | StreamError

# An engine stamp further behind the gateway's receipt than this is not on the gateway's clock (the engine runs on
# another host, whose CLOCK_MONOTONIC counts from its own boot): the receipt starts the text's wait instead.
MAX_ENGINE_LEAD_S = 30.0


def text_started_at(piece: TextPiece, now: float) -> tuple[float, bool]:
    """(when the piece's text started on its way out, whether that is the engine's sampling time): the engine's
    stamp when it is on this host's clock, else the gateway's receipt (`now` when the runtime did not stamp it)."""
    received = piece.received_at if piece.received_at is not None else now
    sampled = piece.sampled_at
    if sampled is not None and 0.0 <= received - sampled <= MAX_ENGINE_LEAD_S:
        return sampled, True
    return received, False


RUNTIME_DEAD = "runtime_dead"  # RuntimeFailure code: the session's stream to the runtime is gone (see below)


class RuntimeFailure(Exception):
    """A fenced operation failed; `code` is a runtime code of the Triton contract, or `RUNTIME_DEAD` when the
    session's stream itself broke (Triton died or restarted). Then the session's `events` end as well, which
    the session reports once as `runtime_dead`; an operation failed by the same break adds nothing to it."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Readiness:
    live: bool
    ready: bool
    models: Mapping[str, bool]
    reasons: tuple[str, ...] = ()

    @property
    def all_ready(self) -> bool:
        return self.live and self.ready and bool(self.models) and all(self.models.values())


class Runtime(Protocol):
    """Fenced session operations. Each coroutine resolves when the runtime has acknowledged the request
    (its final response) and raises `RuntimeFailure` with the runtime code otherwise."""

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None: ...
    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None: ...
    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None: ...
    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None: ...
    async def close(self, key: SessionKey, fence: Fence) -> None: ...
    def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]: ...
    async def readiness(self) -> Readiness: ...
    async def aclose(self) -> None: ...


# Runtime codes (triton_contract.md) -> protocol.md §1.7 codes per operation.
def map_runtime_code(op: str, code: str) -> str:
    if code in ("runtime_backpressure", RUNTIME_DEAD):
        return code
    if code == "timeout":
        return "runtime_timeout"
    if op == "open":
        return "runtime_open_failed"
    if op == "update":
        return "invalid_runtime_config" if code == "invalid_runtime_config" else "runtime_update_failed"
    if op == "append":
        return "bad_audio" if code == "bad_audio" else "runtime_append_failed"
    if op == "cancel":
        return "runtime_signal_failed"
    if op == "close":
        return "runtime_close_failed"
    return "internal_error"
