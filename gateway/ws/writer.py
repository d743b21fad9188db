"""The writer: the only code that sends on a WebSocket (protocol.md §1.3 Writer, §1.4, §3.9).

It dequeues, drops stale streaming items (S-1; a pair as a unit, consuming no seq, S-2), projects to the
profile, stamps `event_id` / `server_event_seq`, serialises, sends, and closes the socket when an item
asks for it. It never changes session state.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gateway.protocol.profiles import Projector
from gateway.session.ids import EventIds
from gateway.session.outbox import Kind, Outbox, OutItem

log = logging.getLogger(__name__)


class Socket(Protocol):
    async def send_text(self, data: str) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class Writer:
    def __init__(self, socket: Socket, outbox: Outbox, projector: Projector,
                 is_stale: Callable[[OutItem], bool] = lambda item: False,
                 on_drop: Callable[[str], None] = lambda t: None) -> None:
        self._socket, self._outbox, self._projector = socket, outbox, projector
        self.is_stale = is_stale
        self._on_drop = on_drop
        self._ids = EventIds()
        self.seq = 0
        self.closed = False

    def last_seq(self) -> int:
        return self.seq

    def frame(self, ev: dict[str, Any], sequenced: bool) -> str | None:
        out = self._projector.project(ev)
        if out is None:
            return None
        msg: dict[str, Any] = {"type": out["type"], "event_id": self._ids.next()}
        if sequenced:
            self.seq += 1
            msg["server_event_seq"] = self.seq
        msg.update((k, v) for k, v in out.items() if k not in msg and k != "event_id")
        return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)

    async def run(self, stop: Callable[[], Awaitable[None]] | None = None) -> None:
        while True:
            item = await self._outbox.get()
            if self.is_stale(item):
                for ev in item.events:
                    self._on_drop(ev["type"])
                continue
            sequenced = item.kind is not Kind.UNSEQUENCED
            for ev in item.events:
                text = self.frame(ev, sequenced)
                if text is not None:
                    await self._socket.send_text(text)
            if item.close is not None:
                code, reason = item.close
                self.closed = True
                await self._socket.close(code=code, reason=reason)
                return
