"""The system prefix fed in chunks (`Stage0Config.prefix_chunk`): the same KV and sampled ids as one forward
(model.md I5), and a long prefix no longer holds other sessions' units for its whole forward."""

from __future__ import annotations

import pytest
import torch

from engine.stage0 import Fence, Stage0Config, TokenEvent, UnitDone
from engine.stage0.session import Phase
from tests.engine.test_stage0_engine import by_session, make_engine, params
from tests.engine.test_stage0_helpers import unit_pcm

ATOL = 1e-5
PROMPT = "You are a patient assistant on a long phone call. " * 4  # a prefix of well over 16 positions


def _run(chunk: int) -> tuple[list, torch.Tensor, int]:
    """One session with PROMPT, three units; its events, its KV slot and its prefix length."""
    engine, events = make_engine(sessions=2, prefix_chunk=chunk)
    engine.open("s1", Fence(1, 0), prompt=PROMPT, params=params(1))
    for k in range(3):
        engine.append("s1", Fence(1, 0, seq=k), unit_pcm(1, k))
    engine.run_until_idle()
    s = engine.session("s1")
    return by_session(events, "s1"), engine.runner.kv.k[0][s.slot, :, :s.cached_len].clone(), s.prefix_len


@pytest.mark.parametrize("chunk", [1, 16, 37])
def test_chunked_prefix_equals_one_forward(chunk: int) -> None:
    got, got_kv, got_prefix = _run(chunk)
    want, want_kv, want_prefix = _run(0)
    assert got_prefix == want_prefix > 16
    key = [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else None) for e in want]
    assert [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else None) for e in got] == key
    torch.testing.assert_close(got_kv, want_kv, atol=ATOL, rtol=ATOL)


def test_other_sessions_run_between_the_chunks_of_a_long_prefix() -> None:
    """s2 is open and idle; s1 opens with a long prefix fed 8 positions a step; s2's unit is decided while s1's
    prefix is still being fed (one forward of the whole prefix would have held it until the prefix was in)."""
    engine, events = make_engine(sessions=2, prefix_chunk=8)
    engine.open("s2", Fence(1, 0), params=params(2))
    engine.run_until_idle()
    engine.open("s1", Fence(1, 0), prompt=PROMPT, params=params(1))
    engine.append("s2", Fence(1, 0, seq=0), unit_pcm(2, 0))
    s1 = engine.session("s1")
    total = s1.prefix_rows.shape[0]
    fed = []
    while not any(isinstance(e, UnitDone) and e.session_id == "s2" for e in events):
        assert engine.step()
        fed.append(s1.cached_len)
    assert s1.phase is Phase.PREFIX and fed[-1] < total  # s2's unit is done, s1's prefix is not yet in
    assert fed[:3] == [8, 16, 24]
    engine.run_until_idle()
    assert s1.phase is Phase.IDLE and s1.prefix_len == s1.cached_len == total


def test_room_counts_only_the_prefix_not_yet_fed() -> None:
    engine, _ = make_engine(sessions=1, prefix_chunk=8)
    engine.open("s1", Fence(1, 0), prompt=PROMPT, params=params(1))
    s = engine.session("s1")
    total = s.prefix_rows.shape[0]
    assert s.prefix_to_feed() == total
    engine.step()
    assert s.cached_len == 8 and s.prefix_to_feed() == total - 8
    engine.run_until_idle()
    assert s.prefix_to_feed() == 0


def test_prefix_chunk_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prefix_chunk"):
        Stage0Config(prefix_chunk=-1)
