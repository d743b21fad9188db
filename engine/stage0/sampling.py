"""LLM sampling for the duplex loop (model.md §3.5), batched per row.

Every row carries its own parameters and its own pre-drawn uniforms (u_a for Step A, u_b for Step B),
taken from the session's CPU generator (`UniformStream`), so a session's output never depends on which
other rows share the batch. The kernel is pure tensor code with no host sync and no sort of the vocabulary; the
caller reads back the chosen ids, the number of draws each row consumed and whether the row's top-k fit the
candidates (else it draws that row again with the full-vocabulary rule, `sample(..., candidates=None)`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import deque
from dataclasses import dataclass

import torch

from engine.hostio import to_device
from engine.sampling_draw import draw, draw_uniforms, session_generator
from engine.stage0.penalty import MAX_REPETITION_WINDOW, HistoryRing
from engine.stage0.topkp import candidate_draw, full_draw

__all__ = ["SamplerIds", "SamplingBatch", "SamplingParams", "UniformStream", "draw", "sample", "table_rows"]

# Logits per row that top-k and top-p run on (`candidate_draw`); a row needing more is drawn over the vocabulary
TOP_CANDIDATES = 64
# Uniforms a session's stream draws from its generator at once: one CPU `torch.rand` per 32 steps, not per step
PREDRAW = 64


@dataclass(frozen=True)
class SamplingParams:
    """Per-session sampling settings (model.md §3.9 defaults)."""

    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 512
    turn_eos_length_penalty: float = 1.1
    listen_prob_scale: float = 1.0
    listen_top_k: int = 0  # 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature <= 0 or not 0 < self.top_p <= 1 \
                or self.top_k < 1:
            raise ValueError(f"bad sampling parameters: {self}")
        if self.repetition_penalty <= 0 or self.turn_eos_length_penalty <= 0 or not \
                1 <= self.repetition_window <= MAX_REPETITION_WINDOW:
            raise ValueError(f"bad penalty parameters: {self}")

    def with_temperature(self, temperature: float) -> SamplingParams:
        """These settings with another temperature. 0 means greedy: Step B6 divides by the temperature, so
        the sampler itself needs T > 0, and the limit T -> 0 of the draw is the argmax."""
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature {temperature} must be finite and >= 0")
        if temperature == 0:
            return dataclasses.replace(self, greedy=True)
        return dataclasses.replace(self, greedy=False, temperature=temperature)


class UniformStream:
    """The session's draw primitive source (§3.5.4, engine.sampling_draw): fp64 scalars, in draw order.

    `peek(n)` pre-draws without consuming, so a batched kernel can receive both Step-A and Step-B
    uniforms before it is known whether Step B is reached; `consume(n)` then commits what was used.
    """

    def __init__(self, seed: int) -> None:
        self._gen = session_generator(seed)
        self._ahead: deque[float] = deque()
        self.consumed = 0

    def peek(self, n: int) -> list[float]:
        if len(self._ahead) < n:  # a block at a time: the same values as n scalar draws (draw_uniforms)
            self._ahead.extend(draw_uniforms(self._gen, max(n - len(self._ahead), PREDRAW)).tolist())
        return list(itertools.islice(self._ahead, n))

    def consume(self, n: int) -> None:
        self.peek(n)
        for _ in range(n):
            self._ahead.popleft()
        self.consumed += n


@dataclass(frozen=True)
class SamplerIds:
    """Token ids the sampler needs, read from the tokenizer by the caller."""

    chunk_eos: int
    turn_eos: int
    listen_bias: int  # `listen_bias_token` (Q4), `<|listen|>` by default
    masked: tuple[int, ...]  # `<|tts_pad|>`, bad_token_ids and `<|chunk_eos|>` (Step B1)


@dataclass
class SamplingBatch:
    """Per-row sampling inputs on the logits' device. All [B] unless noted."""

    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # fp32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # fp32
    repetition_penalty: torch.Tensor  # fp32
    turn_eos_penalty: torch.Tensor  # fp32
    listen_scale: torch.Tensor  # fp32
    listen_top_k: torch.Tensor  # int64, 0 = off
    history: torch.Tensor  # [B, V] bool: id occurs in the last `repetition_window` Step-B draws
    u_a: torch.Tensor  # fp64
    u_b: torch.Tensor  # fp64
    slots: torch.Tensor | None = None  # int64: the rows' ring slots (`from_ring`)
    count: torch.Tensor | None = None  # int64: the rows' history lengths (`from_ring`)

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[list[int]], uniforms: list[list[float]],
              vocab: int, device: torch.device | str) -> SamplingBatch:
        """From host histories: only the (row, id) pairs travel to the device, not a [B, V] mask."""
        b = len(params)
        rows, cols = [], []
        for i, (p, h) in enumerate(zip(params, histories, strict=True)):
            recent = h[-p.repetition_window:]
            rows += [i] * len(recent)
            cols += recent
        hist = torch.zeros(b, vocab, dtype=torch.bool, device=device)
        if cols:
            pairs = to_device(torch.tensor([rows, cols], dtype=torch.long), device)  # [2, n]
            hist[pairs[0], pairs[1]] = True
        table = to_device(table_rows(params, uniforms, [0] * b, [0] * b), device).T
        return cls(**_fields(table), history=hist)

    @classmethod
    def from_ring(cls, params: list[SamplingParams], uniforms: list[list[float]], ring: HistoryRing,
                  slots: list[int], device: torch.device | str) -> SamplingBatch:
        """From the device history ring (synced by the caller): the mask is built on the device."""
        return cls.from_table(to_device(table_rows(params, uniforms, slots, [ring.count[s] for s in slots]),
                                        device), ring)

    @classmethod
    def from_table(cls, rows: torch.Tensor, ring: HistoryRing) -> SamplingBatch:
        """From `table_rows` already on the device ([B, 13]) and the ring: device work only (graph-safe)."""
        table = rows.T
        slot_t, count = table[10].long(), table[11].long()
        hist = ring.mask(slot_t, count, table[12].long())
        return cls(**_fields(table), history=hist, slots=slot_t, count=count)


@functools.lru_cache(maxsize=8)
def _masked_index(masked: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The Step B1 ids on the device, copied once per device (read-only)."""
    return to_device(torch.tensor(masked, dtype=torch.long), device)


def table_rows(params: list[SamplingParams], uniforms: list[list[float]], slots: list[int], counts: list[int]
               ) -> torch.Tensor:
    """Every per-row scalar in one host fp64 block [B, 13], copied in one go (exact for these ints, bools and
    fp32s): the parameters, the row's two uniforms, its ring slot, history length and window."""
    return torch.tensor(
        [[p.greedy, p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.turn_eos_length_penalty,
          p.listen_prob_scale, p.listen_top_k, u[0], u[1], slot, n, p.repetition_window]
         for p, u, slot, n in zip(params, uniforms, slots, counts, strict=True)],
        dtype=torch.float64)


def _fields(table: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(greedy=table[0].bool(), temperature=table[1].float(), top_k=table[2].long(),
                top_p=table[3].float(), repetition_penalty=table[4].float(), turn_eos_penalty=table[5].float(),
                listen_scale=table[6].float(), listen_top_k=table[7].long(), u_a=table[8], u_b=table[9])


def sample(logits: torch.Tensor, batch: SamplingBatch, ids: SamplerIds, candidates: int | None = TOP_CANDIDATES
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One `sample(logits)` per row (§3.5). logits [B, V] (bf16 or fp32; processed in fp32).

    Returns (token [B] int64, draws [B] int64 consumed from the row's stream, appended [B] bool: the
    token came from Step B6 and joins `generated_history`, exact [B] bool: False where the row's top-k did
    not fit the `candidates` and the row must be drawn again with `candidates=None`, the full-vocabulary
    rule). The draws of a row do not depend on which rule drew it.
    """
    x = logits.float()
    a_hit = _chunk_end(x, batch, ids.chunk_eos)  # Step A
    # Step B1: masks
    # index_fill_ with a scalar: `y[:, idx] = -inf` copies the scalar to the device first, a blocking copy that
    # made the host wait for the step's forward before it could queue the sampling (CUDA sync debug mode)
    y = x.clone().index_fill_(1, _masked_index(ids.masked, x.device), float("-inf"))
    # B2: repetition penalty divides regardless of sign (Q2)
    y = torch.where(batch.history, y / batch.repetition_penalty[:, None], y)
    # B3: `<|turn_eos|>` length penalty (Q3)
    te = y[:, ids.turn_eos]
    y[:, ids.turn_eos] = torch.where(te > 0, te / batch.turn_eos_penalty, te * batch.turn_eos_penalty)
    # B4-B5: listen bias scale and listen_top_k early return
    y[:, ids.listen_bias] = y[:, ids.listen_bias] * batch.listen_scale
    n_above = (y > y[:, ids.listen_bias:ids.listen_bias + 1]).sum(-1)
    early = (batch.listen_top_k > 0) & (n_above < batch.listen_top_k)
    # B6: greedy argmax, or temperature → top-k → top-p → draw
    z = y / batch.temperature[:, None]
    if candidates is None:
        drawn, exact = full_draw(z, batch.top_k, batch.top_p, batch.u_b), torch.ones_like(a_hit)
    else:
        drawn, exact = candidate_draw(z, batch.top_k, batch.top_p, batch.u_b, candidates)
    b_tok = torch.where(batch.greedy, y.argmax(-1), drawn)
    token = torch.where(a_hit, ids.chunk_eos, torch.where(early, ids.listen_bias, b_tok))
    draws = torch.where(batch.greedy, 0, torch.where(a_hit | early, 1, 2))
    appended = ~a_hit & ~early
    return token, draws, appended, exact | batch.greedy | a_hit | early


def _chunk_end(x: torch.Tensor, batch: SamplingBatch, chunk_eos: int) -> torch.Tensor:
    """Step A → [B] bool: the draw from softmax(raw logits) is `<|chunk_eos|>` (greedy: it is the argmax).

    The draw picks id c when cdf[c − 1] <= u · Σp < cdf[c], so two sums decide it: no cumsum over the
    vocabulary. (The draw's rounding fallback, the last id with p > 0, is not c unless every later id's
    probability underflows to 0; that case is left out.)
    """
    p = torch.softmax(x, dim=-1)  # [B, V]
    below = p[:, :chunk_eos].sum(-1)  # mass of the ids before c, in fp32
    target = batch.u_a.to(torch.float32) * p.sum(-1)
    drawn = (below <= target) & (target < below + p[:, chunk_eos])
    return torch.where(batch.greedy, x.argmax(-1) == chunk_eos, drawn)
