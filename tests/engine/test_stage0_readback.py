"""One id read-back per engine step (issue 16, STYLE.md practice 2): the step's only host sync."""

from __future__ import annotations

import pytest

import engine.stage0.loop as loop
from engine.stage0 import DecodeRules, Fence, SamplingParams
from tests.engine.test_stage0_engine import make_engine
from tests.engine.test_stage0_helpers import unit_pcm


def test_every_step_reads_back_at_most_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(t):  # the real read-back, counted
        calls.append(t.shape[-1])
        return real(t)

    real = loop.read_back
    monkeypatch.setattr(loop, "read_back", counted)
    engine, _ = make_engine(sessions=4, rules=DecodeRules(force_listen_count=0))
    for i in range(4):
        # top_k 20 (the default) fits the sampler's candidates; a top_k above them costs a second read-back
        engine.open(f"s{i}", Fence(1, 0), params=SamplingParams(temperature=1.5, seed=i))
    per_step, rows = [], []
    for k in range(3):
        for i in range(4):
            engine.append(f"s{i}", Fence(1, 0, seq=k), unit_pcm(i, k))
        while True:
            before = len(calls)
            if not engine.step():
                break
            per_step.append(len(calls) - before)
            rows += calls[before:]
    assert max(per_step) == 1 and sum(per_step) > 10
    assert max(rows) > 1  # the rows of a step come back together, not one read-back each
