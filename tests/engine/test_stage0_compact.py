"""Slot compaction (issue 16): after sessions close, the live ones move into the lowest slots, so the dense
decode runs at the bucket of the live sessions; a moved session's output is what it would have been."""

from __future__ import annotations

import torch

from engine.stage0 import DecodeRules, Fence, TokenEvent, UnitDone
from tests.engine.test_stage0_engine import by_session, make_engine, params
from tests.engine.test_stage0_helpers import tiny_llm, unit_pcm

ATOL = 1e-5
UNITS = 4


def _run(close_early: bool) -> tuple[list, dict[str, int]]:
    engine, events = make_engine(tiny_llm(), sessions=4, rules=DecodeRules(force_listen_count=1),
                                 eager_replay_graphs=True, decode_batch_buckets=(1, 2, 4))
    sids = [f"s{i}" for i in range(4)]
    for sid in sids:
        engine.open(sid, Fence(1, 0), params=params(int(sid[1:])))
    for k in range(UNITS):
        if k == 2 and close_early:  # s0 and s1 leave; s2 and s3 go on from slots 2 and 3
            for sid in ("s0", "s1"):
                engine.close(sid, Fence(1, 0))
        for sid in sids[2:] if k >= 2 else sids:
            engine.append(sid, Fence(1, 0, seq=k), unit_pcm(int(sid[1:]), k))
        engine.run_until_idle()
    return events, {sid: engine.session(sid).slot for sid in sids[2:]}


def test_moved_sessions_go_on_as_if_nothing_moved() -> None:
    moved, slots = _run(close_early=True)
    stayed, kept = _run(close_early=False)
    assert sorted(slots.values()) == [0, 1] and kept == {"s2": 2, "s3": 3}
    for sid in ("s2", "s3"):
        got, want = by_session(moved, sid), by_session(stayed, sid)
        key = [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in got]
        assert key == [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator)
                       for e in want]
        for a, b in zip(got, want, strict=True):
            if isinstance(a, TokenEvent) and a.hidden is not None:
                torch.testing.assert_close(a.hidden, b.hidden, atol=ATOL, rtol=ATOL)
        assert sum(isinstance(e, UnitDone) for e in got) == UNITS
