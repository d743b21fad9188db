"""Session slot free-list and the KV window eviction with RoPE re-rotation (model.md §7.4)."""

from __future__ import annotations

import torch

from engine.model.llm import Qwen3LLM, SlotKVCache


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
