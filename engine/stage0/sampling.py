"""LLM sampling for the duplex loop (model.md §3.5), batched per row.

Every row carries its own parameters and its own pre-drawn uniforms (u_a for Step A, u_b for Step B),
taken from the session's CPU generator (`UniformStream`), so a session's output never depends on which
other rows share the batch. The kernel is pure tensor code with no host sync; the caller reads back the
chosen ids and the number of draws each row consumed.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

import torch

from engine.sampling_draw import draw, draw_uniforms, session_generator
from engine.stage0.hostio import to_device

__all__ = ["SamplerIds", "SamplingBatch", "SamplingParams", "UniformStream", "draw", "sample"]


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
        if self.repetition_penalty <= 0 or self.turn_eos_length_penalty <= 0 or self.repetition_window < 1:
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
        if len(self._ahead) < n:
            self._ahead.extend(draw_uniforms(self._gen, n - len(self._ahead)).tolist())
        return list(self._ahead)[:n]

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

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[list[int]], uniforms: list[list[float]],
              vocab: int, device: torch.device | str) -> SamplingBatch:
        b = len(params)
        # only the (row, id) pairs travel to the device: at most B × window ids, not a [B, V] mask
        rows, cols = [], []
        for i, (p, h) in enumerate(zip(params, histories, strict=True)):
            recent = h[-p.repetition_window:]
            rows += [i] * len(recent)
            cols += recent
        hist = torch.zeros(b, vocab, dtype=torch.bool, device=device)
        if cols:
            pairs = to_device(torch.tensor([rows, cols], dtype=torch.long), device)  # [2, n]
            hist[pairs[0], pairs[1]] = True
        # every per-row scalar travels in one fp64 block (exact for these ints, bools and fp32 roundings)
        table = to_device(torch.tensor(
            [[p.greedy, p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.turn_eos_length_penalty,
              p.listen_prob_scale, p.listen_top_k, u[0], u[1]] for p, u in zip(params, uniforms, strict=True)],
            dtype=torch.float64), device).T  # [10, B]
        return cls(
            greedy=table[0].bool(), temperature=table[1].float(), top_k=table[2].long(), top_p=table[3].float(),
            repetition_penalty=table[4].float(), turn_eos_penalty=table[5].float(),
            listen_scale=table[6].float(), listen_top_k=table[7].long(), history=hist,
            u_a=table[8], u_b=table[9],
        )


def sample(logits: torch.Tensor, batch: SamplingBatch, ids: SamplerIds) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """One `sample(logits)` per row (§3.5). logits [B, V] (bf16 or fp32; processed in fp32).

    Returns (token [B] int64, draws [B] int64 consumed from the row's stream, appended [B] bool: the
    token came from Step B6 and joins `generated_history`).
    """
    x = logits.float()
    vocab = x.shape[-1]
    # Step A: chunk-end pre-draw on the raw logits
    a_tok = torch.where(batch.greedy, x.argmax(-1), draw(torch.softmax(x, -1), batch.u_a))
    a_hit = a_tok == ids.chunk_eos
    # Step B1: masks
    y = x.clone()
    y[:, to_device(torch.tensor(ids.masked, dtype=torch.long), x.device)] = float("-inf")  # no pageable copy
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
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)  # ties: ascending id
    kth = sorted_z.gather(1, (batch.top_k.clamp(max=vocab) - 1)[:, None])
    sorted_z = torch.where(sorted_z >= kth, sorted_z, float("-inf"))
    sorted_p = torch.softmax(sorted_z, dim=-1)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above
    sorted_z = torch.where(before > batch.top_p[:, None], float("-inf"), sorted_z)
    z = torch.full_like(z, float("-inf")).scatter(1, order, sorted_z)
    b_tok = torch.where(batch.greedy, y.argmax(-1), draw(torch.softmax(z, -1), batch.u_b))
    token = torch.where(a_hit, a_tok, torch.where(early, ids.listen_bias, b_tok))
    draws = torch.where(batch.greedy, 0, torch.where(a_hit | early, 1, 2))
    appended = ~a_hit & ~early
    return token, draws, appended
