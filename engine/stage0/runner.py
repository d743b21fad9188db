"""The model runner: the only owner of the LLM weights and the KV tensors.

`forward(rows)` returns each row's final-norm hidden states. Rows are split by kind:

- single-token rows (decoded tokens, A1 `<|turn_eos|>`): one batched embedding lookup, then the dense slot
  layout (row = slot), through `DecodeGraphs` when captured;
- multi-token rows that fit a prefill bucket (unit prefills, closes): through `PrefillGraphs` when
  captured, in chunks of the largest batch bucket;
- both kinds in one step (`Stage0Config.mixed_step`): "split" runs the two above; "merge" has the single-token
  rows join the prefill graph as rows of one position while all fit one chunk; "shared" runs both kinds in one
  `SharedGraphs` pass when it covers them (one pass over the weights instead of two);
- everything else (system prefixes, or no graphs): one eager padded forward with gathered slots.

Padding writes land in the scratch slot (gathered) or the reserved position (dense).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.hostio import to_device
from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, SharedGraphs

KV_LIMIT_QUANTUM = 256  # eager attention spans a multiple of this many positions (fewer shapes)


@dataclass(frozen=True)
class Row:
    slot: int
    start: int  # cache length before the row = position of its first input
    embeds: torch.Tensor | None = None  # [T, H]
    token: int | None = None  # or one token id, embedded together with the batch's other tokens

    @property
    def length(self) -> int:
        return 1 if self.embeds is None else self.embeds.shape[0]


class ModelRunner:
    def __init__(self, model: Qwen3LLM, kv: SlotKVCache, graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None, decode_attention: str | None = None,
                 mixed_step: str = "split", shared_graphs: SharedGraphs | None = None) -> None:
        self.model = model
        self.mixed_step = mixed_step
        self.shared_graphs = shared_graphs  # "shared": both kinds of rows in one pass
        self.decode_attention = decode_attention  # the eager decode rows' (None: the model's class default)
        self.kv = kv
        self.graphs = graphs  # decode
        self.prefill_graphs = prefill_graphs
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._marks: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def embed(self, ids: list[int]) -> torch.Tensor:
        """[T] ids → [T, H] embeddings on the runner's device."""
        return self.model.embed(to_device(torch.tensor(ids, dtype=torch.long), self.device))

    def embed_marks(self, *ids: int) -> torch.Tensor:
        """`embed` of a few special ids (`<unit>`, a close `[terminator, </unit>]`, `<image>`), kept: a unit step
        builds them for every session, and each fresh lookup is a host → device copy (6 ms of a 32-unit step on the
        H200, stop 29). The embedding table does not change once the engine is built."""
        rows = self._marks.get(ids)
        if rows is None:
            rows = self._marks[ids] = self.embed(list(ids))
        return rows

    @torch.no_grad()
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """Returns per-row hidden states [T_i, H], in row order."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        single = [i for i, r in enumerate(rows) if r.length == 1]
        multi = [i for i in range(len(rows)) if rows[i].length > 1]
        pg = self.prefill_graphs
        graphed = [i for i in multi if pg is not None and pg.covers(1, rows[i].length)]
        eager = [i for i in multi if i not in graphed]
        if single and graphed and pg is not None:
            sg = self.shared_graphs
            if self.mixed_step == "merge" and len(graphed) + len(single) <= pg.batch_buckets[-1]:
                graphed, single = graphed + single, []
            elif sg is not None and sg.covers(len(graphed), max(rows[i].length for i in graphed),
                                              max(rows[i].slot for i in single)):
                units, tokens = self._shared([rows[i] for i in graphed], [rows[i] for i in single])
                for i, h in zip(graphed, units, strict=True):
                    out[i] = h
                for i, h in zip(single, tokens, strict=True):
                    out[i] = h[None]
                graphed, single = [], []
        if single:
            for i, h in zip(single, self._decode([rows[i] for i in single]), strict=True):
                out[i] = h[None]
        if graphed:
            assert pg is not None
            chunk = pg.batch_buckets[-1]
            embeds = self._embeds_of([rows[i] for i in graphed])
            for c in range(0, len(graphed), chunk):
                part = graphed[c:c + chunk]
                hidden = pg.run([rows[i].slot for i in part], [rows[i].start for i in part], embeds[c:c + chunk])
                for i, h in zip(part, hidden, strict=True):
                    out[i] = h
        if eager:
            for i, h in zip(eager, self._eager([rows[i] for i in eager]), strict=True):
                out[i] = h
        return out  # type: ignore[return-value] - every index is filled above

    def _shared(self, units: list[Row], tokens: list[Row]) -> tuple[list[torch.Tensor], torch.Tensor]:
        assert self.shared_graphs is not None
        return self.shared_graphs.run([r.slot for r in units], [r.start for r in units], self._embeds_of(units),
                                      self._token_inputs(tokens), torch.tensor([r.start for r in tokens]),
                                      torch.tensor([r.slot for r in tokens]))

    def _token_inputs(self, rows: list[Row]) -> torch.Tensor:
        """Single-token rows → [N, H]: one lookup in the usual case (one host → device copy)."""
        if all(r.embeds is None for r in rows):
            return self.embed([r.token for r in rows])  # type: ignore[misc]
        return torch.cat([self._embeds(r) for r in rows])

    def _embeds_of(self, rows: list[Row]) -> list[torch.Tensor]:
        """Each row's [T, H] input; the token rows' in one lookup (one host → device copy)."""
        tokens = [r.token for r in rows if r.embeds is None]
        looked = iter(self.embed(tokens)[:, None]) if tokens else iter(())  # type: ignore[arg-type]
        return [next(looked) if r.embeds is None else r.embeds.to(self.dtype) for r in rows]

    def _embeds(self, row: Row) -> torch.Tensor:
        return row.embeds.to(self.dtype) if row.embeds is not None else self.embed([row.token])  # type: ignore[list-item]

    def _decode(self, rows: list[Row]) -> torch.Tensor:
        """Single-token rows → [N, H]: dense layout (row = slot), no KV gather; CUDA graph when captured."""
        x = self._token_inputs(rows)  # [N, H]
        pos = torch.tensor([r.start for r in rows], dtype=torch.long)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        reach = int(pos.max()) + 1
        if self.graphs is not None:
            return self.graphs.run(x, pos, slots, reach)
        n = int(slots.max()) + 1
        dense_pos = torch.full((n, 1), self.kv.reserved_pos, dtype=torch.long)
        dense_pos[slots, 0] = pos
        dense_x = torch.zeros(n, 1, x.shape[-1], dtype=self.dtype, device=self.device)
        dev_slots = to_device(slots, self.device)
        dense_x[dev_slots, 0] = x
        hidden = self.model(dense_x, to_device(dense_pos, self.device), None, self.kv, kv_limit=self._limit(reach),
                            decode_attention=self.decode_attention)
        return hidden[dev_slots, 0]

    def _eager(self, rows: list[Row]) -> list[torch.Tensor]:
        b, t = len(rows), max(r.length for r in rows)
        reach = max(r.start + r.length for r in rows)
        x = torch.zeros(b, t, self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
        pos = torch.zeros(b, t, dtype=torch.long)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for i, r in enumerate(rows):
            x[i, :r.length] = self._embeds(r)
            pos[i, :r.length] = torch.arange(r.start, r.start + r.length)
            valid[i, :r.length] = True
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        hidden = self.model(x, to_device(pos, self.device), to_device(slots, self.device), self.kv,
                            valid=to_device(valid, self.device), kv_limit=self._limit(reach))
        return [hidden[i, :r.length] for i, r in enumerate(rows)]

    def _limit(self, reach: int) -> int:
        return min(self.kv.max_len, -(-reach // KV_LIMIT_QUANTUM) * KV_LIMIT_QUANTUM)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] → [N, V] (lm_head in the model dtype)."""
        return self.model.logits(hidden)
