"""An in-process fake of the Triton `duplex` pipeline (test helper only; never imported by product code).

It follows the runtime contract (notes/triton_contract.md, protocol.md §4.4): fenced appends, cancel with
F-1..F-5, one event stream per session, and a scripted model: `plan[unit]` says what the model does in that
unit (default: listen). Every operation is logged in `ops` so tests can check what crossed the boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.runtime.base import (
    AudioPiece,
    Decision,
    Fence,
    Readiness,
    RuntimeEvent,
    RuntimeFailure,
    SessionKey,
    TextPiece,
    UnitDone,
    UnitSubmission,
)

OUT_RATE = 24000


@dataclass(frozen=True)
class Speak:
    text: str = "hello "
    audio_ms: int = 1000
    end_of_turn: bool = False
    tokens: int = 3
    calls: bool = False  # the audio's two pieces carry Token2Wav's `last` flag (two calls), else no flag


@dataclass(frozen=True)
class Listen:
    end_of_turn: bool = False


@dataclass
class _Seq:
    epoch: int = 0
    incarnation: int = 0
    queue: asyncio.Queue[RuntimeEvent | None] = field(default_factory=asyncio.Queue)
    force_next: bool = False
    dead_epochs: set[int] = field(default_factory=set)
    closed: bool = False


def tone(ms: int) -> bytes:
    n = OUT_RATE * ms // 1000
    return (np.sin(np.arange(n) * 0.05) * 8000).astype("<i2").tobytes()


def unit_metrics(tokens: int, unit: int = 0) -> dict[str, Any]:
    times = [10.0 + 5.0 * i for i in range(tokens)]
    return {"thinker": {"tokens": tokens, "ttft_ms": 10.0, "token_times_ms": times},
            "talker": {"first_output_ms": 7.0, "from_unit_ms": 40.0},
            "code2wav": {"first_output_ms": 3.0, "from_unit_ms": 45.0},
            "unit_done": {"from_unit_ms": 20.0 + unit}}  # the gateway's stamp (stages.py), as the staged runtime adds it


class FakeRuntime:
    def __init__(self) -> None:
        self.ops: list[tuple[str, Any]] = []
        self.seqs: dict[int, _Seq] = {}
        self.plan: dict[int, Speak | Listen] = {}
        self.ready = True
        self.fail: dict[str, str] = {}  # op -> runtime code, raised once
        self.failing: dict[str, str] = {}  # op -> runtime code, raised every time until the test removes it
        self.append_delay_s = 0.0
        self.units_seen: list[UnitSubmission] = []
        self.configs: list[Mapping[str, Any]] = []
        self.hold = asyncio.Event()  # cleared by a test to stall appends (U3 wait)
        self.hold.set()

    def _maybe_fail(self, op: str) -> None:
        code = self.fail.pop(op, None) or self.failing.get(op)
        if code is not None:
            raise RuntimeFailure(code, f"injected {op} failure")

    async def open(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        self.ops.append(("open", fence))
        self._maybe_fail("open")
        self.seqs[key.correlation_id] = _Seq(epoch=fence.epoch, incarnation=fence.incarnation)
        self.configs.append(config)

    async def append(self, key: SessionKey, fence: Fence, unit: UnitSubmission) -> None:
        seq = self.seqs[key.correlation_id]
        self.ops.append(("append", (fence, unit.unit_index, unit.force_listen, unit.synthetic)))
        await self.hold.wait()
        if self.append_delay_s:
            await asyncio.sleep(self.append_delay_s)
        if fence.epoch < seq.epoch or fence.epoch in seq.dead_epochs or fence.incarnation != seq.incarnation:
            raise RuntimeFailure("stale_fence", "stale")  # F-4
        self._maybe_fail("append")
        self.units_seen.append(unit)
        forced = unit.force_listen or seq.force_next
        seq.force_next = False
        action = Listen() if forced else self.plan.get(unit.unit_index, Listen())
        e, u, q = fence.epoch, unit.unit_index, seq.queue
        if isinstance(action, Listen):
            q.put_nowait(Decision(epoch=e, unit=u, action="listen", forced=forced))
            q.put_nowait(UnitDone(epoch=e, unit=u, is_listen=True, end_of_turn=action.end_of_turn,
                                  metrics=unit_metrics(1, u), forced=forced))
            return
        q.put_nowait(Decision(epoch=e, unit=u, action="speak"))
        words = action.text
        for i in range(action.tokens):
            piece = words[i * len(words) // action.tokens:(i + 1) * len(words) // action.tokens]
            q.put_nowait(TextPiece(epoch=e, unit=u, text=piece, token_id=i))
        pcm = tone(action.audio_ms)
        half = len(pcm) // 4 * 2
        q.put_nowait(AudioPiece(epoch=e, unit=u, seq=0, pcm16=pcm[:half], last=False if action.calls else None))
        q.put_nowait(AudioPiece(epoch=e, unit=u, seq=1, pcm16=pcm[half:], last=True if action.calls else None))
        q.put_nowait(UnitDone(epoch=e, unit=u, is_listen=False, end_of_turn=action.end_of_turn,
                              metrics=unit_metrics(action.tokens, u)))

    async def cancel(self, key: SessionKey, fence: Fence, next_fence: Fence) -> None:
        seq = self.seqs[key.correlation_id]
        self.ops.append(("cancel", (fence, next_fence)))
        self._maybe_fail("cancel")
        if next_fence.epoch != fence.epoch + 1 or next_fence.incarnation != fence.incarnation:
            raise RuntimeFailure("invalid_fence", "F-1")
        if seq.epoch > fence.epoch:
            return  # F-2
        seq.dead_epochs.add(fence.epoch)
        seq.epoch = next_fence.epoch
        seq.force_next = True  # F-5: close the turn, force listen next unit

    async def update(self, key: SessionKey, fence: Fence, config: Mapping[str, Any]) -> None:
        self.ops.append(("update", fence))
        self._maybe_fail("update")
        self.configs.append(config)

    async def close(self, key: SessionKey, fence: Fence) -> None:
        self.ops.append(("close", fence))
        seq = self.seqs.get(key.correlation_id)
        if seq is not None:
            seq.closed = True
            seq.queue.put_nowait(None)
        self._maybe_fail("close")

    async def events(self, key: SessionKey) -> AsyncIterator[RuntimeEvent]:
        seq = self.seqs[key.correlation_id]
        while True:
            ev = await seq.queue.get()
            if ev is None:
                return
            yield ev

    def inject(self, key_corr: int, ev: RuntimeEvent) -> None:
        self.seqs[key_corr].queue.put_nowait(ev)

    async def readiness(self) -> Readiness:
        return Readiness(self.ready, self.ready, {"duplex": self.ready}, () if self.ready else ("fake not ready",))

    async def aclose(self) -> None:
        return None
