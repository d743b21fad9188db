"""The writer: the only code that sends a session's events (protocol.md §1.3 Writer, §1.4, §3.9, §6.3).

One writer per session, outliving sockets. It dequeues, drops stale streaming items (S-1; a pair as a unit,
consuming no seq, S-2), projects to the profile, stamps `event_id` / `server_event_seq` through the journal's
sequencer (J-1: the exact bytes sent are journaled), and sends to the socket of the current attachment, or
to nobody while detached (the events are journaled all the same). It never changes session state.
`lock` is held around each item so that a resume can put `session.resumed` and the replay in front of any
live event (RS9). For every item that carries generated text (a transcript pair or a text delta) it reports how
long that text waited, from its start (`OutItem.text_at`) to the writer handing the item to the socket (P13).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from gateway.protocol.profiles import Projector
from gateway.resume.journal import Sequencer
from gateway.session.ids import EventIds
from gateway.session.outbox import Kind, Outbox, OutItem

log = logging.getLogger(__name__)
Json = dict[str, Any]
TEXT_DELTA = "response.output_text.delta"  # a text-only response's delta; every other text item is an audio pair
TextWaited = Callable[[float, bool, bool], None]  # (seconds, the response carries audio, from the engine's stamp)


class Socket(Protocol):
    async def send_text(self, data: str) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class Writer:
    def __init__(self, outbox: Outbox, projector: Projector, sequencer: Sequencer, *,
                 is_stale: Callable[[OutItem], bool] = lambda item: False,
                 on_drop: Callable[[str], None] = lambda t: None,
                 on_sent: Callable[[Json], None] = lambda ev: None,
                 on_send_failed: Callable[[int], None] = lambda generation: None,
                 on_text_sent: TextWaited = lambda seconds, audio, sampled: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._outbox, self._projector, self.sequencer = outbox, projector, sequencer
        self.is_stale = is_stale
        self._on_drop, self._on_sent, self._on_send_failed = on_drop, on_sent, on_send_failed
        self._on_text_sent, self._clock = on_text_sent, clock
        self._ids = EventIds()
        self.socket: Socket | None = None
        self.generation = 0
        self.lock = asyncio.Lock()
        self.closed = False

    def attach(self, socket: Socket, generation: int) -> None:
        self.socket, self.generation = socket, generation

    def detach(self, generation: int) -> None:
        if generation == self.generation:
            self.socket = None

    def last_seq(self) -> int:
        return self.sequencer.last_seq

    def serialise(self, out: Json, seq: int | None) -> str:
        msg: Json = {"type": out["type"], "event_id": self._ids.next()}
        if seq is not None:
            msg["server_event_seq"] = seq
        msg.update((k, v) for k, v in out.items() if k not in msg and k != "event_id")
        return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)

    def frames(self, ev: Json, sequenced: bool) -> list[str]:
        """Project and serialise one canonical event; sequenced ones go through the journal."""
        out = self._projector.project(ev)
        if out is None:
            return []
        return self.sequencer.frames(lambda seq: self.serialise(out, seq), sequenced=sequenced)

    async def send(self, text: str, socket: Socket | None = None) -> bool:
        """Send on `socket` (default: the attached one). False when there is none or the send failed."""
        target = socket if socket is not None else self.socket
        if target is None:
            return False
        try:
            await target.send_text(text)
        except Exception:  # noqa: BLE001 - any send failure is a transport error of that attachment (§6.2)
            if target is self.socket:
                self.socket = None
                self._on_send_failed(self.generation)
            return False
        return True

    async def run(self) -> None:
        while True:
            item = await self._outbox.get()
            async with self.lock:
                if self.is_stale(item):
                    for ev in item.events:
                        self._on_drop(ev["type"])
                    continue
                sequenced = item.kind is not Kind.UNSEQUENCED
                handed = self._clock() if item.text_at is not None else 0.0
                sent = False
                for ev in item.events:
                    texts = self.frames(ev, sequenced)
                    if texts and self.socket is not None and all([await self.send(t) for t in texts]):
                        self._on_sent(ev)
                        sent = True
                if sent and item.text_at is not None:  # P13: only text that reached a client counts
                    self._on_text_sent(handed - item.text_at, item.events[0]["type"] != TEXT_DELTA, item.text_sampled)
                if item.close is not None:
                    self.closed = True
                    await self.close_socket(*item.close)
                    return

    async def close_socket(self, code: int, reason: str, socket: Socket | None = None) -> None:
        target = socket if socket is not None else self.socket
        if target is None:
            return
        if target is self.socket:
            self.socket = None
        try:
            await target.close(code=code, reason=reason)
        except Exception:  # noqa: BLE001 - already gone
            log.debug("close of a gone socket")
