"""Session slot free-list, slot compaction and the KV window eviction with RoPE re-rotation (model.md §7.4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.llm import Qwen3LLM, SlotKVCache

if TYPE_CHECKING:
    from engine.stage0.session import Session


class SlotTable:
    """A free-list of KV slots; lowest free slot first so layouts are reproducible."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def free(self) -> int:
        return len(self._free)

    def lowest(self) -> int | None:
        """The slot `take` would return, without taking it."""
        return self._free[-1] if self._free else None


def compact(sessions: list[Session], table: SlotTable, kv: SlotKVCache) -> None:
    """Move the session in the highest slot into the lowest free slot while that one is lower.

    Decode runs in the dense layout (row = slot), so its batch bucket, and the KV every decode step reads,
    follow the highest live slot, not the number of live sessions: after sessions close, the live ones move
    down (a copy of their retained KV, once per close) and the step runs at the smaller bucket. Call it on
    the engine thread between steps, when every session's KV is complete up to `cached_len`.
    """
    while sessions and (low := table.lowest()) is not None:
        s = max(sessions, key=lambda s: s.slot)
        if s.slot < low:
            return
        assert table.take() == low
        move_slot(kv, s.slot, low, s.cached_len)
        table.give(s.slot)
        s.slot = low


@torch.no_grad()
def move_slot(kv: SlotKVCache, src: int, dst: int, length: int) -> None:
    """Copy positions [0, length) of slot `src` into slot `dst` (every layer's keys and values)."""
    for cache in (*kv.k, *kv.v):
        cache[dst, :, :length] = cache[src, :, :length]


@torch.no_grad()
def evict_span(model: Qwen3LLM, kv: SlotKVCache, slot: int, start: int, drop: int, length: int) -> None:
    """Remove positions [start, start + drop) of `slot` and shift the suffix [start + drop, length) down.

    Suffix keys are re-rotated by −drop positions (fp32, stored in the cache dtype); values move as is.
    """
    if drop <= 0:
        return
    for k_cache, v_cache in zip(kv.k, kv.v, strict=True):
        suffix_k = k_cache[slot, :, start + drop:length]  # [kvh, S, D]
        k_cache[slot, :, start:length - drop] = model.rotate_keys(suffix_k, drop)
        v_cache[slot, :, start:length - drop] = v_cache[slot, :, start + drop:length].clone()
