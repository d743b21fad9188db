"""Static per-batch tensors of one TTS unit, shared by the prefill and single-code step graphs.

The same layout also holds the continuous engine's lanes (`TTSEngineConfig.continuous`): one row per lane, each
lane with its own step counter, rows joining (`adopt`) and leaving (`release`) between steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class UnitState:
    """Inputs/outputs of one unit for `size` rows (pad rows: scratch slot, never valid).

    The step reads its code, position, penalty window and uniform from `samples` / `u` at the device
    step counter `t`, writes its sample back and advances `t`: a replay needs no host-side copy-in.
    `t` is one counter for the whole unit, or one per row (`per_row`: lanes that started at different steps).
    """

    samples: torch.Tensor  # [B, W + S] int64: W empty-window columns (= V), then sample t at W + t
    t: torch.Tensor  # [1] int64, the sample index the next step produces (1 .. S-1)
    start: torch.Tensor  # [B] int64, turn position of condition row 0
    n_rows: torch.Tensor  # [B] int64, text rows n (audio_bos sits at row n)
    slot: torch.Tensor  # [B] int64
    valid: torch.Tensor  # [B] bool, False for pad rows
    eos_blocked: torch.Tensor  # [B] bool
    u: torch.Tensor  # [B, S] fp64
    temperature: torch.Tensor  # [B] fp32, the row's session's talker temperature (pad rows keep a valid one)
    penalty: torch.Tensor  # [B] fp32, its repetition penalty
    per_row: bool = False  # t is [B], one counter per row

    @classmethod
    def allocate(cls, size: int, window: int, steps: int, vocab: int, scratch: int,
                 device: torch.device, temperature: float = 1.0, penalty: float = 1.0,
                 per_row: bool = False) -> UnitState:
        i64 = dict(dtype=torch.int64, device=device)
        samples = torch.full((size, window + steps), vocab, **i64)
        samples[:, window:] = 0  # sample columns must always hold valid codes (graph warm-up feeds them)
        return cls(samples=samples, t=torch.ones(size if per_row else 1, **i64), per_row=per_row,
                   start=torch.zeros(size, **i64), n_rows=torch.zeros(size, **i64),
                   slot=torch.full((size,), scratch, **i64),
                   valid=torch.zeros(size, dtype=torch.bool, device=device),
                   eos_blocked=torch.ones(size, dtype=torch.bool, device=device),
                   u=torch.full((size, steps), 0.5, dtype=torch.float64, device=device),
                   temperature=torch.full((size,), temperature, dtype=torch.float32, device=device),
                   penalty=torch.full((size,), penalty, dtype=torch.float32, device=device))

    @property
    def size(self) -> int:
        return self.samples.shape[0]

    def make_padding(self, scratch: int) -> None:
        """Turn every row into a pad row (before a capture: stale rows could index out of range)."""
        self.start.fill_(0)
        self.n_rows.fill_(0)
        self.slot.fill_(scratch)
        self.valid.fill_(False)

    def load(self, *, start: list[int], n_rows: list[int], slots: list[int], eos_allowed: list[bool],
             u: torch.Tensor, scratch: int, temperature: list[float] | None = None,
             penalty: list[float] | None = None) -> None:
        """Copy one batch of b ≤ size rows in; rows past b become pad rows."""
        b, dev = len(start), self.samples.device
        host = torch.tensor([start, n_rows, slots, [int(not a) for a in eos_allowed]], dtype=torch.int64)
        host = host.to(dev, non_blocking=True)  # one transfer for the four per-row columns
        self.start[:b].copy_(host[0])
        self.n_rows[:b].copy_(host[1])
        self.slot[:b].copy_(host[2])
        self.eos_blocked[:b].copy_(host[3].bool())
        self.valid[:b].fill_(True)
        self.u[:b].copy_(u, non_blocking=True)
        if temperature is not None and penalty is not None:  # else the rows keep theirs (always valid ones)
            sampling = torch.tensor([temperature, penalty], dtype=torch.float32).to(dev, non_blocking=True)
            self.temperature[:b].copy_(sampling[0])
            self.penalty[:b].copy_(sampling[1])
        if b < self.size:
            self.start[b:].fill_(0)
            self.n_rows[b:].fill_(0)
            self.slot[b:].fill_(scratch)
            self.valid[b:].fill_(False)

    # -- lanes (per-row t) -----------------------------------------------------------------------------
    _ROWS = ("samples", "start", "n_rows", "slot", "valid", "eos_blocked", "u", "temperature", "penalty")

    def view(self, b: int) -> UnitState:
        """The first b rows, sharing storage (a graph captured on the view replays on these rows)."""
        assert self.per_row, "view: only lanes (per-row t) can be cut by rows"
        rows = {name: getattr(self, name)[:b] for name in self._ROWS}
        return dataclasses.replace(self, t=self.t[:b], **rows)

    def adopt(self, lanes: torch.Tensor, src: UnitState) -> None:
        """Rows 0..k-1 of `src` (a prefilled unit state: sample 0 drawn) become lanes `lanes` [k], at t = 1."""
        k = lanes.shape[0]
        for name in self._ROWS:
            getattr(self, name).index_copy_(0, lanes, getattr(src, name)[:k])
        self.t.index_fill_(0, lanes, 1)

    def release(self, lanes: torch.Tensor, scratch: int) -> None:
        """Lanes [k] become pad rows: later steps write only the scratch slot's KV through them."""
        self.valid.index_fill_(0, lanes, False)
        self.slot.index_fill_(0, lanes, scratch)
        self.start.index_fill_(0, lanes, 0)
        self.n_rows.index_fill_(0, lanes, 0)
        self.t.index_fill_(0, lanes, 1)
