"""Sampling without a vocabulary sort (issue 16): top-k on candidates == the full-vocabulary rule, and the
repetition history kept on the device == the host's `generated_history` (model.md §3.5.2 B2, B6, B7)."""

from __future__ import annotations

import pytest
import torch

from engine.stage0 import DecodeRules, Fence, TokenEvent
from engine.stage0.penalty import HistoryRing
from engine.stage0.sampling import SamplingBatch, SamplingParams
from engine.stage0.topkp import candidate_draw, full_draw
from tests.engine.test_stage0_engine import by_session, make_engine, params
from tests.engine.test_stage0_helpers import unit_pcm

V = 3000


def _rows(seed: int, b: int, ties: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, V, generator=g) * 4
    if ties:  # coarse values: many equal logits around the k-th, as bf16 logits give
        z = (z * 2).round() / 2
    z[:, torch.randint(0, V, (20,), generator=g)] = float("-inf")  # masked ids
    top_k = torch.randint(1, 80, (b,), generator=g)
    top_p = torch.rand(b, generator=g) * 0.9 + 0.1
    u = torch.rand(b, dtype=torch.float64, generator=g)
    return z, top_k, top_p, u


@pytest.mark.parametrize("ties", [False, True])
def test_candidate_draw_equals_full_vocabulary_rule(ties: bool) -> None:
    checked = flagged = 0
    for seed in range(6):
        z, top_k, top_p, u = _rows(seed, 32, ties)
        got, exact = candidate_draw(z, top_k, top_p, u, candidates=64)
        want = full_draw(z, top_k, top_p, u)
        assert torch.equal(got[exact], want[exact])
        assert not exact[top_k > 64].any()  # a top_k above the candidates is never claimed exact
        checked, flagged = checked + int(exact.sum()), flagged + int((~exact).sum())
        # batch independence: each row alone gives the same id
        for i in range(0, 32, 7):
            solo, _ = candidate_draw(z[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], u[i:i + 1], candidates=64)
            assert solo.item() == got[i].item()
    assert checked > 100 and flagged > 0


def test_candidate_draw_flags_ties_past_the_candidates() -> None:
    z = torch.zeros(1, V)
    z[0, :5] = 2.0  # 5 clear winners, then V - 5 equal logits: top_k = 10 keeps all of them
    got, exact = candidate_draw(z, torch.tensor([10]), torch.tensor([1.0]), torch.tensor([0.99], dtype=torch.float64),
                                candidates=64)
    assert not exact.item()
    assert full_draw(z, torch.tensor([10]), torch.tensor([1.0]), torch.tensor([0.99], dtype=torch.float64)).item() > 64


def _host_mask(history: list[int], window: int) -> torch.Tensor:
    return SamplingBatch.build([SamplingParams(repetition_window=window)], [history], [[0.0, 0.0]], V, "cpu").history[0]


class Owner:
    """A session as the ring sees it: any object it can hold weakly."""


def test_history_ring_matches_host_history_through_appends_undo_growth_and_reuse() -> None:
    g = torch.Generator().manual_seed(0)
    ring = HistoryRing(slots=3, capacity=16, vocab=V, device="cpu")
    hist: dict[int, list[int]] = {0: [], 1: [5, 6, 7], 2: []}
    owners = {slot: Owner() for slot in hist}
    windows = {0: 10, 1: 16, 2: 3}

    def check() -> None:
        slots = list(hist)
        ring.sync([(s, owners[s], hist[s], windows[s]) for s in slots])
        mask = ring.mask(torch.tensor(slots), torch.tensor([len(hist[s]) for s in slots]),
                         torch.tensor([windows[s] for s in slots]))
        for i, s in enumerate(slots):
            assert torch.equal(mask[i], _host_mask(hist[s], windows[s])), (s, hist[s])

    for step in range(60):
        check()
        slots = torch.tensor(list(hist))
        token = torch.randint(0, 40, (3,), generator=g)  # few ids: repeats inside the window
        appended = torch.rand(3, generator=g) > 0.3
        ring.append(slots, torch.tensor([len(hist[s]) for s in hist]), token, appended, list(hist))
        for s, t, a in zip(list(hist), token.tolist(), appended.tolist(), strict=True):
            if a:
                hist[s].append(t)
            if s != 2 or step % 9:  # now and then a row is left unsettled (its step raised): it reloads
                ring.settle(s, owners[s], len(hist[s]))
        if step == 20:
            del hist[0][-4:]  # a failed step undoes its appends
        if step == 30:
            owners[1], hist[1] = Owner(), []  # another session takes slot 1
        if step == 40:
            windows[2] = 40  # wider than the ring: it grows and every slot reloads
    check()
    assert ring.capacity >= 40


def test_engine_ring_equals_each_session_history() -> None:
    engine, _ = make_engine(sessions=3, rules=DecodeRules(force_listen_count=0))
    for i in range(3):
        engine.open(f"s{i}", Fence(1, 0), params=params(i))
    for k in range(4):
        for i in range(3):
            engine.append(f"s{i}", Fence(1, 0, seq=k), unit_pcm(i, k))
        engine.run_until_idle()
    ring, total = engine.history_ring, 0
    for i in range(3):
        s = engine.session(f"s{i}")
        w = s.params.repetition_window
        got = ring.mask(torch.tensor([s.slot]), torch.tensor([len(s.history)]), torch.tensor([w]))[0]
        vocab = engine.model.cfg.vocab_size
        want = SamplingBatch.build([s.params], [s.history], [[0.0, 0.0]], vocab, "cpu").history[0]
        assert ring.count[s.slot] == len(s.history) and torch.equal(got, want)
        total += len(s.history)
    assert total > 0


def _tokens(sids: list[str]) -> dict[str, list[int]]:
    engine, events = make_engine(sessions=3, rules=DecodeRules(force_listen_count=0))
    for sid in sids:  # top_k 20: the candidate path (the engine tests' `params` draw over the whole vocabulary)
        engine.open(sid, Fence(1, 0), params=SamplingParams(temperature=1.5, seed=int(sid[1:])))
    for k in range(3):
        for sid in sids:
            engine.append(sid, Fence(1, 0, seq=k), unit_pcm(int(sid[1:]), k))
        engine.run_until_idle()
    return {sid: [e.token_id for e in by_session(events, sid) if isinstance(e, TokenEvent)] for sid in sids}


def test_engine_batched_equals_solo_on_the_candidate_path() -> None:
    batched = _tokens(["s0", "s1", "s2"])
    for sid in batched:
        assert _tokens([sid])[sid] == batched[sid]
    assert sum(len(t) for t in batched.values()) > 12
