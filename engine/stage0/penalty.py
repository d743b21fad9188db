"""The repetition-penalty history on the device (model.md §3.5.2 B2, B7), one ring of ids per slot.

The host keeps each session's `generated_history` (the truth, trimmed when a failed step is undone); the
ring is a device copy of its last `capacity` ids that the step appends to with device tensors, so a
step builds its [B, V] penalty mask from the ring instead of copying up to B × 512 ids from Python. A row
whose ring does not match its host history (a new session in the slot, an undone step, a window wider
than the ring) is reloaded from the host before the step: a rare path.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from engine.hostio import to_device

# The longest repetition window a session may ask for (SamplingParams): a session keeps this many of its latest
# Step-B draws (engine/stage0/session.py DrawHistory), so its history does not grow with its length (P11).
MAX_REPETITION_WINDOW = 4096


class HistoryRing:
    """ids [slots, capacity] int64 on the device: entry n of a slot's history lives at n % capacity."""

    def __init__(self, slots: int, capacity: int, vocab: int, device: torch.device | str) -> None:
        self.vocab, self.device = vocab, torch.device(device)
        self.count = [0] * slots  # history entries the ring holds (its last `capacity`) per slot
        # the session each slot's ring mirrors, held weakly: a closed session's state (its front end's audio
        # KV slot among it) must not live on until its slot is reused
        self.owner: list[weakref.ref | None] = [None] * slots
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        # `vocab` marks an empty entry: it scatters into a column that is cut off (see `mask`)
        self.ids = torch.full((len(self.count), capacity), self.vocab, dtype=torch.long, device=self.device)
        self.owner = [None] * len(self.count)  # every slot reloads into the new ring

    def sync(self, rows: list[tuple[int, object, Sequence[int], int]]) -> None:
        """Make each (slot, owner, history, window) row's ring hold the last `window` ids of `history`;
        only a mismatched row is reloaded, and a wider window first grows the ring (all rows reload)."""
        widest = max((window for *_, window in rows), default=0)
        if widest > self.capacity:
            self._allocate(min(max(widest, 2 * self.capacity), MAX_REPETITION_WINDOW))  # widest <= the max
        for slot, owner, history, _ in rows:
            if not self._mirrors(slot, owner) or self.count[slot] != len(history):
                self._load(slot, owner, history)

    def _load(self, slot: int, owner: object, history: Sequence[int]) -> None:
        row = torch.full((self.capacity,), self.vocab, dtype=torch.long)
        start = max(0, len(history) - self.capacity)
        for n in range(start, len(history)):
            row[n % self.capacity] = history[n]
        self.ids[slot] = to_device(row, self.device)
        self.count[slot], self.owner[slot] = len(history), weakref.ref(owner)

    def _mirrors(self, slot: int, owner: object) -> bool:
        ref = self.owner[slot]
        return ref is not None and ref() is owner

    def mask(self, slots: torch.Tensor, count: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """[B, V] bool: the id occurs in the row's last `window` entries. slots, count, window: [B] int64
        on the device (count = the row's history length)."""
        ring = self.ids[slots]  # [B, W]
        positions = torch.arange(self.capacity, device=ring.device)
        age = torch.remainder(count[:, None] - 1 - positions, self.capacity)  # [B, W]: 0 = the newest entry
        valid = age < torch.minimum(window, count)[:, None]
        cols = torch.where(valid, ring, self.vocab)
        hist = torch.zeros(ring.shape[0], self.vocab + 1, dtype=torch.bool, device=ring.device)
        return hist.scatter_(1, cols, True)[:, :self.vocab]

    def append(self, slots: torch.Tensor, count: torch.Tensor, token: torch.Tensor, appended: torch.Tensor,
               host_slots: list[int]) -> None:
        """Device-side B7: each row's token joins its ring where `appended` (no host sync). The rows count as
        stale until `settle` says the host history took the same ids: a step that raises in between leaves
        them stale, and they reload."""
        pos = torch.remainder(count, self.capacity)
        self.ids[slots, pos] = torch.where(appended, token, self.ids[slots, pos])
        for slot in host_slots:
            self.owner[slot] = None

    def settle(self, slot: int, owner: object, length: int) -> None:
        """The slot's ring now mirrors `owner`'s host history of `length` ids."""
        self.owner[slot], self.count[slot] = weakref.ref(owner), length
