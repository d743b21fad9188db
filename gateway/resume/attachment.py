"""Attachment lifecycle of one session (protocol.md §6.2, §6.5): which socket owns it, and what a loss means.

`attachment_generation` starts at 1 and grows by one per successful resume. Every inbound event and every
outbound write is tagged with the generation of its socket; `is_current` is the single check that discards
a replaced socket's frames (TK-3) and makes its late disconnect a no-op (TK-4).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass


class AttachState(enum.StrEnum):
    ATTACHED = "attached"
    DETACHED = "detached"
    CLOSED = "closed"


class LossAction(enum.StrEnum):
    IGNORE = "ignore"  # a replaced (older-generation) socket went away: TK-4
    DETACH = "detach"  # keep slot and runtime, start the grace timer
    CLOSE = "close"  # close the session with `LossOutcome.reason`


@dataclass(frozen=True, slots=True)
class LossOutcome:
    action: LossAction
    reason: str | None = None  # session.closed reason when action is CLOSE


@dataclass(frozen=True, slots=True)
class Takeover:
    new_generation: int
    replaced_generation: int | None  # the live socket that gets `session.replaced`, if any (TK-1/TK-2)

    def replaced_event(self, session_id: str) -> dict[str, object] | None:
        """TK-2 payload for the old socket (unsequenced, never journaled)."""
        if self.replaced_generation is None:
            return None
        return {"type": "session.replaced", "session_id": session_id,
                "attachment_generation": self.replaced_generation, "reason": "takeover"}


class Attachments:
    def __init__(self, *, resumable: bool) -> None:
        self.generation = 1
        self.state = AttachState.ATTACHED
        self.resumable = resumable
        self.created_delivered = False  # set once `session.created` has been written
        self.resume_lock = asyncio.Lock()  # RS7: resumes of one session run one at a time

    def is_current(self, generation: int) -> bool:
        """§1.3 attachment tag: only the current, attached socket may act on the session."""
        return generation == self.generation and self.state is AttachState.ATTACHED

    def on_socket_lost(self, generation: int, *, transport_error: bool = False) -> LossOutcome:
        """§6.2: socket closed without `session.close`, or a send failed."""
        if generation != self.generation or self.state is not AttachState.ATTACHED:
            return LossOutcome(LossAction.IGNORE)
        if not self.created_delivered:
            return self._close("session_created_undelivered")
        if not self.resumable:
            return self._close("transport_error" if transport_error else "disconnect")
        self.state = AttachState.DETACHED
        return LossOutcome(LossAction.DETACH)

    def mark_unresumable(self) -> LossOutcome:
        """Journal overflow (J-4): nobody can resume; a detached session closes at once (§6.2)."""
        self.resumable = False
        if self.state is AttachState.DETACHED:
            return self._close("journal_overflow")
        return LossOutcome(LossAction.IGNORE)

    def activate(self) -> Takeover:
        """RS8 after `session.resumed` was written: bump the generation; a live socket is replaced."""
        if self.state is AttachState.CLOSED:
            raise RuntimeError("cannot activate a closed session")
        replaced = self.generation if self.state is AttachState.ATTACHED else None
        self.generation += 1
        self.state = AttachState.ATTACHED
        return Takeover(self.generation, replaced)

    def close(self) -> None:
        self.state = AttachState.CLOSED

    def _close(self, reason: str) -> LossOutcome:
        self.state = AttachState.CLOSED
        return LossOutcome(LossAction.CLOSE, reason)
