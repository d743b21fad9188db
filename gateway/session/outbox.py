"""The session's outbound queue (protocol.md §1.3 writer, §1.5 limits, §3.6 K0).

The session puts canonical events here; only the connection writer takes them out. A streaming
item is one audio/transcript pair or one text delta (C-3: a pair is queued, dropped and sent as a
unit). `purge_stream` implements K0: a cancellation deletes the response's unsent deltas so the
done transcript equals what was really sent.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]


class Kind(enum.Enum):
    STREAM = "stream"  # response.speak, delta pairs, text deltas: subject to S-1 at send time
    NORMAL = "normal"  # sequenced, never dropped (terminals, item events, session state)
    UNSEQUENCED = "unsequenced"  # attachment control and frame rejections (§1.4)


@dataclass(frozen=True, slots=True)
class OutItem:
    events: tuple[Json, ...]
    kind: Kind = Kind.NORMAL
    epoch: int | None = None
    response_id: str | None = None
    model_turn_id: int | None = None
    audio_ms: int = 0  # playback bytes this item carries (sent_ms accounting)
    text: str = ""  # transcript/text this item carries (sent transcript accounting)
    # P13: time.monotonic() when that text started on its way out (the engine's sampling of its first token, or the
    # gateway's receipt of it: `text_sampled` says which); the writer observes how long it waited
    text_at: float | None = None
    text_sampled: bool = False
    close: tuple[int, str] | None = None  # the writer closes the socket after sending this item
    size: int = field(default=0, compare=False)


class OutboxOverflow(Exception):
    pass


@dataclass(frozen=True, slots=True)
class OutboxLimits:
    max_bytes: int
    max_events: int
    reserve_bytes: int
    reserve_events: int


class Outbox:
    def __init__(self, limits: OutboxLimits) -> None:
        self._limits = limits
        self._items: collections.deque[OutItem] = collections.deque()
        self._bytes = 0
        self._events = 0
        self._ready = asyncio.Event()

    def put(self, item: OutItem, *, reserved: bool = False) -> None:
        """Queue an item. Terminal and error items may use the reserve (§1.5); overflow raises."""
        size = sum(len(json.dumps(e, separators=(",", ":"))) for e in item.events)
        extra_b = self._limits.reserve_bytes if reserved else 0
        extra_e = self._limits.reserve_events if reserved else 0
        if (self._bytes + size > self._limits.max_bytes + extra_b
                or self._events + len(item.events) > self._limits.max_events + extra_e):
            raise OutboxOverflow(f"outbound queue over {self._bytes + size} B / {self._events + 1} events")
        self._items.append(OutItem(**{**{f: getattr(item, f) for f in item.__dataclass_fields__}, "size": size}))
        self._bytes += size
        self._events += len(item.events)
        self._ready.set()

    def purge_stream(self, response_id: str) -> list[OutItem]:
        """K0: remove and return the response's queued, unsent streaming items."""
        kept: collections.deque[OutItem] = collections.deque()
        purged: list[OutItem] = []
        for it in self._items:
            (purged if it.kind is Kind.STREAM and it.response_id == response_id else kept).append(it)
        self._items = kept
        for it in purged:
            self._bytes -= it.size
            self._events -= len(it.events)
        return purged

    async def get(self) -> OutItem:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        it = self._items.popleft()
        self._bytes -= it.size
        self._events -= len(it.events)
        return it

    def __len__(self) -> int:
        return len(self._items)
