"""The receive side of `DuplexClient`: processed-event history, waiters, and routing into response handles.

Owned by the client's reader task (the only writer); applications read it through `wait_for`, `mark`,
`next_response` and the `responses` map.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from clients.connection import DuplexError
from clients.events import (
    AudioDelta,
    ErrorEvent,
    ResponseCreated,
    ResponseDone,
    ResponseScoped,
    ServerEvent,
    TextDelta,
)
from clients.response import ResponseHandle

AUDIO_END_TYPES = ("output_audio_buffer.cleared", "response.output_audio.done")


class SessionEndedError(DuplexError):
    """Raised to waiters when the session ends before the awaited event arrives."""


class Inbox:
    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]], clock: Callable[[], float]) -> None:
        self.history: list[ServerEvent] = []  # every processed event, in order (replay duplicates excluded)
        self.responses: dict[str, ResponseHandle] = {}
        self.ended = False
        self._waiters: list[asyncio.Future[None]] = []
        self._send, self._clock = send, clock

    def add(self, ev: ServerEvent, t: float) -> None:
        self._route(ev, t)
        self.history.append(ev)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def _route(self, ev: ServerEvent, t: float) -> None:
        if isinstance(ev, ResponseCreated):
            self.responses[ev.response_id] = ResponseHandle(ev, t, self._send, self._clock)
            return
        handle = self.responses.get(getattr(ev, "response_id", None) or "")
        if handle is None:
            return
        if isinstance(ev, AudioDelta):
            handle._on_audio(ev, t)
            if ev.transcript is not None:
                handle._on_text(ev.transcript)
        elif isinstance(ev, TextDelta):
            handle._on_text(ev.delta)
        elif isinstance(ev, ResponseDone):
            handle._on_done(ev, t)
        elif isinstance(ev, ResponseScoped) and ev.type in AUDIO_END_TYPES:
            handle._on_audio_end(t, cleared=ev.type == "output_audio_buffer.cleared")

    # -- application API -----------------------------------------------------------------------------
    def mark(self) -> int:
        """A cursor into `history` for `wait_for(..., since=mark)`."""
        return len(self.history)

    async def wait_for(self, type_: str | None, *, since: int = 0, timeout: float | None = None,  # noqa: ASYNC109
                       where: Callable[[ServerEvent], bool] = lambda ev: True) -> ServerEvent:
        """The first event at or after history index `since` of `type_` (None: any) satisfying `where`."""
        async def _scan() -> ServerEvent:
            i = since
            while True:
                for ev in self.history[i:]:
                    i += 1
                    if (type_ is None or ev.type == type_) and where(ev):
                        return ev
                if self.ended:
                    raise SessionEndedError(f"session ended while waiting for {type_ or 'an event'}")
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                await fut
        return await asyncio.wait_for(_scan(), timeout)

    async def next_response(self, *, since: int = 0, timeout: float | None = None) -> ResponseHandle:  # noqa: ASYNC109
        """The first response created at or after history index `since`."""
        ev = await self.wait_for("response.created", since=since, timeout=timeout)
        assert isinstance(ev, ResponseCreated)
        return self.responses[ev.response_id]

    def errors(self) -> list[ErrorEvent]:
        return [ev for ev in self.history if isinstance(ev, ErrorEvent)]
