"""A session's Step-B history keeps its latest draws only (P11: bench/kv_growth.py saw 13,144 draws an hour,
stored forever), while everything that reads it sees what the whole history would give."""

from __future__ import annotations

import random

import pytest
import torch

from engine.stage0.penalty import MAX_REPETITION_WINDOW, HistoryRing
from engine.stage0.sampling import SamplingBatch, SamplingParams
from engine.stage0.session import DrawHistory

N = 3 * MAX_REPETITION_WINDOW + 17  # several trims


def _filled(n: int = N) -> tuple[DrawHistory, list[int]]:
    rng = random.Random(0)
    full = [rng.randrange(1000) for _ in range(n)]
    h = DrawHistory()
    for t in full:
        h.append(t)
    return h, full


def test_the_length_counts_every_draw_and_the_store_stays_bounded() -> None:
    h, full = _filled()
    assert len(h) == len(full)
    assert MAX_REPETITION_WINDOW <= len(list(h)) < 2 * MAX_REPETITION_WINDOW
    for w in (1, 512, MAX_REPETITION_WINDOW):
        assert h[-w:] == full[-w:]
    assert h[len(full) - 1] == h[-1] == full[-1]
    with pytest.raises(IndexError):
        h[0]  # dropped
    with pytest.raises(IndexError):
        h[0:5]


def test_truncate_rolls_back_a_unit_but_not_past_the_kept_draws() -> None:
    h, full = _filled()
    h.truncate(len(full) - 7)
    assert len(h) == len(full) - 7 and h[-3:] == full[-10:-7]
    with pytest.raises(IndexError):
        h.truncate(10)


def test_the_penalty_sees_the_same_ids_as_with_the_whole_history() -> None:
    h, full = _filled()
    vocab, window = 1000, 512
    params = [SamplingParams(repetition_window=window)]
    want = SamplingBatch.build(params, [full], [[0.0, 0.0]], vocab, "cpu").history[0]
    assert torch.equal(SamplingBatch.build(params, [h], [[0.0, 0.0]], vocab, "cpu").history[0], want)

    class Owner:
        pass

    ring, owner = HistoryRing(1, window, vocab, "cpu"), Owner()
    ring.sync([(0, owner, h, window)])
    got = ring.mask(torch.tensor([0]), torch.tensor([len(h)]), torch.tensor([window]))[0]
    assert torch.equal(got, want)


def test_a_window_longer_than_the_kept_draws_is_refused() -> None:
    SamplingParams(repetition_window=MAX_REPETITION_WINDOW)
    with pytest.raises(ValueError):
        SamplingParams(repetition_window=MAX_REPETITION_WINDOW + 1)
