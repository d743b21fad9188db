"""The model runner: the only owner of the LLM weights and the KV tensors.

`forward(rows)` pads ragged rows into one batch (padding writes land in the scratch slot), runs the LLM,
and returns each row's final-norm hidden states. Single-token batches go through the CUDA-graph runner
when one is active (GPU only) and use the dense slot layout either way; everything else runs eager
with gathered slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0.graphs import DecodeGraphs, dense_inputs

KV_LIMIT_QUANTUM = 256  # eager attention spans a multiple of this many positions (fewer shapes)


@dataclass(frozen=True)
class Row:
    slot: int
    start: int  # cache length before the row = position of its first input
    embeds: torch.Tensor  # [T, H]


class ModelRunner:
    def __init__(self, model: Qwen3LLM, kv: SlotKVCache, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv = kv
        self.graphs = graphs
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @torch.no_grad()
    def embed(self, ids: list[int]) -> torch.Tensor:
        """[T] ids → [T, H] embeddings on the runner's device."""
        return self.model.embed(torch.tensor(ids, dtype=torch.long, device=self.device))

    @torch.no_grad()
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """Returns per-row hidden states [T_i, H]."""
        b, t = len(rows), max(r.embeds.shape[0] for r in rows)
        reach = max(r.start + r.embeds.shape[0] for r in rows)
        kv_limit = min(self.kv.max_len, -(-reach // KV_LIMIT_QUANTUM) * KV_LIMIT_QUANTUM)
        if t == 1:  # decode: dense layout (row = slot), no KV gather; CUDA graph when captured
            x = torch.stack([r.embeds[0] for r in rows])  # [B, H]
            pos = torch.tensor([r.start for r in rows], dtype=torch.long)
            slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
            if self.graphs is not None:
                hidden = self.graphs.run(x, pos, slots, reach)  # [B, H]
            else:
                dense_x, dense_pos = dense_inputs(self.kv, x.to(self.dtype), pos.to(self.device),
                                                  slots.to(self.device), int(slots.max()) + 1)
                hidden = self.model(dense_x, dense_pos, None, self.kv, kv_limit=kv_limit)[slots.to(self.device), 0]
            return [hidden[i:i + 1] for i in range(b)]
        x = torch.zeros(b, t, self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
        pos = torch.zeros(b, t, dtype=torch.long)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for i, r in enumerate(rows):
            n = r.embeds.shape[0]
            x[i, :n] = r.embeds.to(self.dtype)
            pos[i, :n] = torch.arange(r.start, r.start + n)
            valid[i, :n] = True
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        hidden = self.model(x, pos.to(self.device, non_blocking=True), slots.to(self.device, non_blocking=True),
                            self.kv, valid=valid.to(self.device, non_blocking=True), kv_limit=kv_limit)
        return [hidden[i, :r.embeds.shape[0]] for i, r in enumerate(rows)]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] → [N, V] (lm_head in the model dtype)."""
        return self.model.logits(hidden)
