"""`merge_unit_close` (model.md §3.6): the close `[terminator, </unit>]` rides in front of the next prefill.

Checked against the unmerged engine (same ids, same hidden states: the KV is the same sequence), an
offline forward over the fed sequence (I5), the owed-close accounting (I12) and eviction.
"""

from __future__ import annotations

import torch

from engine.model.llm import SlotKVCache
from engine.stage0 import DecodeRules, Fence, TokenEvent, UnitDone
from tests.engine.test_stage0_engine import (
    by_session,
    fed_sequence,
    make_engine,
    offline_hidden,
    params,
    run_schedule,
)
from tests.engine.test_stage0_helpers import tiny_llm, unit_pcm

ATOL = 1e-5


def test_merged_close_equals_separate_close() -> None:
    model = tiny_llm()
    arrivals = {f"s{i}": 2 * i for i in range(4)}
    runs = []
    for merge in (True, False):
        engine, events = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1),
                                     merge_unit_close=merge)
        run_schedule(engine, arrivals, units=5)
        runs.append(events)
    for sid in arrivals:
        got, want = by_session(runs[0], sid), by_session(runs[1], sid)
        assert [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in got] \
            == [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in want]
        for a, b in zip(got, want, strict=True):
            if isinstance(a, TokenEvent) and a.hidden is not None:
                torch.testing.assert_close(a.hidden, b.hidden, atol=ATOL, rtol=ATOL)
    assert any(isinstance(e, UnitDone) and not e.is_listen for e in runs[0])


def test_merged_session_matches_offline_forward_and_owes_the_close() -> None:
    engine, events = make_engine(rules=DecodeRules(force_listen_count=1), merge_unit_close=True)
    engine.open("a", Fence(1, 0), params=params(3))
    engine.run_until_idle()
    ids = engine.ids
    for k in range(5):
        before = engine.session("a").owed_len
        engine.append("a", Fence(1, 0, seq=k), unit_pcm(1, k))
        steps = engine.run_until_idle()
        s = engine.session("a")
        done = [e for e in events if isinstance(e, UnitDone)][-1]
        fed = [e for e in events if isinstance(e, TokenEvent) and e.unit_index == k and e.hidden is not None]
        assert s.pending_close == (done.terminator, ids.unit_close)  # owed, not yet in the KV
        assert s.owed_len == before + 13 + len(fed) and s.cached_len == s.owed_len - 2  # I12
        assert s.ledger_total() == s.owed_len - s.prefix_len
        assert steps == 1 + len(fed)  # one prefill forward per unit, no close forward
    seq, located = fed_sequence(engine, "a", events)
    assert seq.shape[0] == s.owed_len and located
    ref = offline_hidden(engine, seq)
    for pos, e in located:
        torch.testing.assert_close(e.hidden, ref[pos], atol=ATOL, rtol=ATOL)
    n = s.cached_len  # the retained KV equals the offline KV up to the owed close
    kept = engine.runner.kv.k[0][s.slot, :, :n]
    fresh = SlotKVCache.allocate(engine.model.cfg, 1, n, dtype=torch.float32)
    with torch.no_grad():
        engine.model(seq[None, :n], torch.arange(n)[None], torch.tensor([0]), fresh)
    torch.testing.assert_close(kept, fresh.k[0][0], atol=ATOL, rtol=ATOL)


def test_merged_close_with_eviction_keeps_accounting() -> None:
    high, low = 120, 90
    engine, events = make_engine(tiny_llm(seed=1), sessions=1, rules=DecodeRules(force_listen_count=1),
                                 window_high=high, window_low=low, merge_unit_close=True)
    engine.open("a", Fence(1, 0), params=params(4))
    for k in range(10):
        engine.append("a", Fence(1, 0, seq=k), unit_pcm(4, k))
        engine.run_until_idle()
        s = engine.session("a")
        assert s.owed_len <= high and s.ledger_total() == s.owed_len - s.prefix_len
    assert engine.session("a").ledger[0].index > 0, "no eviction happened"
    assert sum(isinstance(e, UnitDone) for e in events) == 10
