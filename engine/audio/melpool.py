"""Every session's mel stream samples in one device tensor (issue 15; STYLE.md practice 4).

A session's slot is a ring of `capacity` fp32 samples: stream sample g lives at position g % capacity, so the
window sliding forward (model.md §2.3) is index arithmetic on the session's host cursors and nothing moves.
The batched front end writes every session's new PCM with one scatter and reads every window with one gather
(LogMel.batch_padded), so the ops it dispatches do not grow with the batch. A slot holds the window and the
samples received ahead of it; the streamer moves a session that would overrun its ring to tensors of its own.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from engine.hostio import to_device


class MelPool:
    """Rings [slots, capacity] of stream samples. `take(owner)` hands out a slot, free again once `owner` is
    garbage (as AudioKVPool: the front end has no close call, and an audio worker may still hold a closed state)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # [slots, capacity] fp32
        if data.numel() >= 2**31:  # LogMel.batch_padded indexes the flat pool in int32
            raise ValueError(f"mel pool of {data.numel()} samples: at most 2**31 - 1")
        # NOTE: list append / pop are atomic under the GIL: the finalizer may run on any thread, so no lock.
        self._free = list(range(data.shape[0] - 1, -1, -1))

    @classmethod
    def allocate(cls, slots: int, capacity: int, device: torch.device | str) -> MelPool:
        return cls(torch.zeros(slots, capacity, device=device, dtype=torch.float32))

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, owner: object) -> int | None:
        try:
            slot = self._free.pop()
        except IndexError:
            return None
        weakref.finalize(owner, self._free.append, slot)
        return slot

    def write(self, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int], pcm: torch.Tensor) -> None:
        """pcm [sum counts] (on the pool's device), laid end to end: session i's `counts[i]` samples go to stream
        indices starts[i].. of slot slots[i]. One host -> device copy of the per-session numbers, one scatter."""
        total = sum(counts)
        if total == 0:
            return
        dev, cap = self.device, self.capacity
        offsets = [0, *itertools.accumulate(counts)][:-1]
        info = to_device(torch.tensor([[s * cap for s in slots], [g - o for g, o in zip(starts, offsets, strict=True)],
                                       list(counts)], dtype=torch.int64), dev)  # [3, B]
        row, shift, count = info.unbind(0)
        seg = torch.repeat_interleave(count, output_size=total)  # [total]: each sample's session (no sync)
        index = (torch.arange(total, device=dev) + shift[seg]).remainder_(cap).add_(row[seg])  # [total]
        self.data.view(-1).index_copy_(0, index, pcm)

    def read(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Stream samples [start, stop) of `slot` -> [stop - start] (a copy)."""
        index = torch.arange(start, stop, device=self.device).remainder_(self.capacity)
        return self.data[slot][index]

    def clear(self, slot: int, count: int) -> None:
        """Zero stream samples [0, count) of `slot` (a new stream's prefix zeros)."""
        self.data[slot, :count].zero_()
