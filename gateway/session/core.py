"""`SessionCore`: what every part of a session reads — identity, the current config, the lifecycle state,
the runtime lane, the outbox and the clock — and the one place they change.

The parts (`InputTrack`, `ResponseTrack`, `ResponseCommands`) hold a reference to it and read it; only the
methods here write it (`apply_config` after a `session.update`, `set_state` at close). Canonical `ga`
events go to the outbox through `emit`; the writer projects and sends them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.protocol.config import ConfigContext, SessionConfig
from gateway.protocol.errors import Effect, ProtocolError, error_event
from gateway.runtime.base import Runtime, SessionKey
from gateway.session.lane import RuntimeLane
from gateway.session.outbox import Kind, Outbox, OutboxOverflow, OutItem

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_pending_input_bytes: int
    max_pending_turns: int
    runtime_timeout_s: float
    close_ack_timeout_s: float
    idle_ttl_s: float | None


class SessionCore:
    def __init__(self, *, session_id: str, incarnation: int, config: SessionConfig, ctx: ConfigContext,
                 limits: SessionLimits, runtime: Runtime, key: SessionKey, outbox: Outbox, lane: RuntimeLane,
                 runtime_config: Json, clock: Callable[[], float]) -> None:
        self.session_id, self.incarnation = session_id, incarnation
        self.config, self.ctx, self.limits = config, ctx, limits
        self.runtime, self.key, self.outbox, self.lane = runtime, key, outbox, lane
        self.runtime_config, self.config_generation = runtime_config, 1
        self.clock = clock
        self.state = "open"
        self.seq_source: Callable[[], int] = lambda: 0  # the writer's highest assigned server_event_seq

    # ---- views -------------------------------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        return self.seq_source()

    @property
    def prefix_committed(self) -> bool:
        return self.lane.acked_appends > 0

    # ---- the only writers of the shared state ------------------------------------------------------------
    def bind_seq_source(self, seq_source: Callable[[], int]) -> None:
        """The writer, once bound, tells the session its highest assigned `server_event_seq`."""
        self.seq_source = seq_source

    def apply_config(self, config: SessionConfig, runtime_config: Json, *, runtime_updated: bool) -> None:
        """Swap in an accepted `session.update` (§2.7 U7); the generation counts runtime ACKs."""
        if runtime_updated:
            self.config_generation += 1
        self.config, self.runtime_config = config, runtime_config

    def restore_config_generation(self, generation: int) -> None:
        """An adopted session (gateway/session/snapshot.py): the runtime ACKs its earlier owner counted."""
        self.config_generation = generation

    def set_state(self, state: str) -> None:
        """open -> closing -> closed (X4)."""
        self.state = state

    # ---- emission --------------------------------------------------------------------------------------
    def emit(self, *events: Json, kind: Kind = Kind.NORMAL, reserved: bool = False, **meta: Any) -> None:
        try:
            self.outbox.put(OutItem(events=tuple(events), kind=kind, **meta), reserved=reserved)
        except OutboxOverflow as exc:
            raise ProtocolError("output_buffer_overflow", str(exc), effect=Effect.CLOSE_SESSION) from None

    def emit_error(self, err: ProtocolError, client_event_id: str | None = None) -> None:
        """A sequenced error (fail-response / report / close-session)."""
        self.emit(error_event(err, client_event_id), reserved=True)
