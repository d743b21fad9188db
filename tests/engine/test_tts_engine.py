"""Stage1 TTS engine: the §5 turn loop against an HF-Llama oracle, I6 batched = solo, I9, I13, errors."""

from __future__ import annotations

import pytest
import torch

from engine.stage1.config import TTSEngineConfig
from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import (
    Fence,
    HiddenDimError,
    RowCountError,
    StaleFenceError,
    TokenIdError,
    TTSUnitRequest,
    TTSUnitResult,
    TurnCapacityError,
    UnknownSessionError,
)
from tests.engine.test_tts_helpers import OracleSession, tiny_model, with_eos_bias

F0 = Fence(incarnation=1, epoch=0)
EOS_BIAS = 12.0  # makes EOS the likely sample wherever it is allowed


def _cfg(**kw: object) -> TTSEngineConfig:
    base = dict(max_sessions=8, max_batch=8, max_turn_positions=512, min_kv_bucket=64)
    return TTSEngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _unit(sid: str, idx: int, n: int, *, end: bool = False, start: bool = False, seed: int = 0,
          fence: Fence = F0) -> TTSUnitRequest:
    g = torch.Generator().manual_seed(1000 * seed + idx)
    ids = tuple(int(x) for x in torch.randint(0, 286, (n,), generator=g))
    return TTSUnitRequest(session_id=sid, fence=fence, unit_index=idx, text_ids=ids,
                          hidden=torch.randn(n, 128, generator=g), is_turn_eos=(False,) * n,
                          end_of_turn=end, turn_start=start)


def _one_row(sid: str, idx: int, ids: tuple[int, ...], hidden: torch.Tensor) -> TTSUnitRequest:
    """A request that claims one row (whatever `ids` and `hidden` hold), mid-turn."""
    return TTSUnitRequest(session_id=sid, fence=F0, unit_index=idx, text_ids=ids, hidden=hidden,
                          is_turn_eos=(False,), end_of_turn=False, turn_start=False)


def _run(engine: TTSEngine) -> list[TTSUnitResult]:
    out: list[TTSUnitResult] = []
    while engine.pending():
        out.extend(engine.step())
    return out


# (rows, end_of_turn) per unit: a turn of three units (incl. an empty Q11 unit), then a new turn
SCRIPT = [(3, False), (0, False), (5, True), (2, False), (4, True)]


@pytest.mark.parametrize("eos_bias", [0.0, EOS_BIAS])
def test_turn_matches_reference_loop(eos_bias: float) -> None:
    """Codes, EOS rules, positions and KV retention/reset equal the reference generate_chunk loop."""
    model = tiny_model()
    oracle = OracleSession(model, seed=7, eos_bias=eos_bias)
    if eos_bias:
        with_eos_bias(model, eos_bias)
    engine = TTSEngine(model, _cfg())
    engine.open("a", F0, seed=7)
    pos = 0
    for i, (n, end) in enumerate(SCRIPT):
        req = _unit("a", i, n, end=end, start=pos == 0)
        engine.submit(req)
        (res,) = _run(engine)
        want = oracle.unit(list(req.text_ids), req.hidden, end)
        assert list(res.codes) == want, i
        assert res.start_pos == pos and res.end_pos == pos + n + 1 + len(res.codes)  # I13 KV length
        eos_allowed = pos == 0 or end
        if not eos_allowed:
            assert len(res.codes) == 25 and not res.eos and res.draws == 26
        pos = 0 if end else res.end_pos
        assert engine.sessions["a"].tts_pos == pos
    if eos_bias:  # EOS was drawn where allowed: turn starts and turn ends stop early
        assert oracle.pos == 0


def test_draw_accounting_and_kv_contents() -> None:
    model = tiny_model()
    engine = TTSEngine(model, _cfg())
    engine.open("a", F0, seed=3)
    engine.submit(_unit("a", 0, 4))
    engine.submit(_unit("a", 1, 2))
    r0, r1 = _run(engine)
    assert (r0.draws, r1.draws) == (26, 26) and r1.start_pos == r0.end_pos  # contiguous positions
    fresh = torch.Generator().manual_seed(3 + 1)
    torch.rand(52, dtype=torch.float64, generator=fresh)
    assert torch.equal(fresh.get_state(), engine.sessions["a"].generator.get_state())
    # the retained KV is exactly what one HF forward over the unit sequence produces (layer 0 keys)
    oracle = OracleSession(model, seed=3)
    for i, n in enumerate((4, 2)):
        req = _unit("a", i, n)
        oracle.unit(list(req.text_ids), req.hidden, False)
    keys = engine.runner.kv.k[0][engine.sessions["a"].slot, :, : r1.end_pos]
    torch.testing.assert_close(keys, oracle.cache.layers[0].keys[0], atol=1e-5, rtol=1e-5)


def test_eos_only_at_turn_start_or_end() -> None:
    model = with_eos_bias(tiny_model(), EOS_BIAS)
    engine = TTSEngine(model, _cfg())
    engine.open("a", F0, seed=1)
    results = []
    for i, (n, end) in enumerate([(3, False), (2, False), (2, False), (1, True)]):
        engine.submit(_unit("a", i, n, end=end))
        results.extend(_run(engine))
    first, mid1, mid2, last = results
    assert first.eos and first.codes == () and first.draws == 1  # turn start: EOS first
    assert first.end_pos == 4 and mid1.start_pos == 4  # the turn stays open after an empty unit
    assert mid1.start_pos > 0 and len(mid1.codes) == 25 and not mid1.eos
    assert len(mid2.codes) == 25 and not mid2.eos
    assert last.eos and last.turn_closed and engine.sessions["a"].tts_pos == 0


def _schedule(engine: TTSEngine, sessions: int) -> list[TTSUnitResult]:
    """8 sessions in different turn states and row counts: some have a finished unit already."""
    out: list[TTSUnitResult] = []
    for s in range(sessions):
        engine.open(f"s{s}", F0, seed=100 + s)
    for s in range(0, sessions, 2):  # half the sessions are mid-turn before the batched steps
        engine.submit(_unit(f"s{s}", 0, 1 + s, seed=s))
    out += _run(engine)
    for s in range(sessions):
        engine.submit(_unit(f"s{s}", 1, (3 * s) % 7, end=s % 3 == 0, seed=s))
        engine.submit(_unit(f"s{s}", 2, 2 + s % 4, seed=s))
    out += _run(engine)
    return sorted(out, key=lambda r: (r.session_id, r.unit_index))


def test_batched_equals_solo_for_8_sessions() -> None:
    model = with_eos_bias(tiny_model(), 6.0)  # EOS sometimes, so rows stop at different steps
    batched = _schedule(TTSEngine(model, _cfg(max_batch=8)), 8)
    solo = _schedule(TTSEngine(model, _cfg(max_batch=1)), 8)
    assert batched == solo
    assert {len(r.codes) for r in batched} > {25}  # early EOS rows and full rows in the same batches
    nonempty = [r.codes for r in batched if r.codes]
    assert len(set(nonempty)) == len(nonempty) > 8


def test_seeded_determinism() -> None:
    model = tiny_model()

    def codes(seed: int) -> tuple[int, ...]:
        engine = TTSEngine(model, _cfg())
        engine.open("a", F0, seed=seed)
        engine.submit(_unit("a", 0, 3))
        return _run(engine)[0].codes

    assert codes(5) == codes(5)
    assert codes(5) != codes(6)


def test_bad_inputs_typed_errors_leave_sessions_unchanged() -> None:
    model = tiny_model()
    clean, dirty = TTSEngine(model, _cfg()), TTSEngine(model, _cfg(max_turn_positions=128))
    for e in (clean, dirty):
        e.open("a", F0, seed=1)
        e.open("b", F0, seed=2)
        e.submit(_unit("a", 0, 3))
        e.submit(_unit("b", 0, 2))
    good = _unit("b", 1, 2)
    bad = [
        (UnknownSessionError, _one_row("zz", 0, (1,), torch.zeros(1, 128))),
        (HiddenDimError, _one_row("b", 1, (1,), torch.zeros(1, 96))),
        (HiddenDimError, _one_row("b", 1, (1,), torch.zeros(1, 128, dtype=torch.int64))),
        (RowCountError, _one_row("b", 1, (1, 2), torch.zeros(1, 128))),
        (TokenIdError, _one_row("b", 1, (320,), torch.zeros(1, 128))),
        (TokenIdError, _one_row("b", 1, (-1,), torch.zeros(1, 128))),
        (StaleFenceError, _unit("b", 1, 2, fence=Fence(2, 0))),
        (TurnCapacityError, _unit("b", 1, 110)),  # 110 rows pass the cap even from a fresh TTS context
    ]
    before = {sid: (s.tts_pos, len(s.queue), s.fence, s.generator.get_state().clone())
              for sid, s in dirty.sessions.items()}
    for exc, req in bad:
        with pytest.raises(exc):
            dirty.submit(req)
    after = {sid: (s.tts_pos, len(s.queue), s.fence, s.generator.get_state())
             for sid, s in dirty.sessions.items()}
    for sid in before:
        assert before[sid][:3] == after[sid][:3] and torch.equal(before[sid][3], after[sid][3])
    for e in (clean, dirty):
        e.submit(good)
    assert _run(clean) == _run(dirty)


def test_cancel_drops_only_that_session() -> None:
    model = tiny_model()
    ref, eng = TTSEngine(model, _cfg()), TTSEngine(model, _cfg())
    for e in (ref, eng):
        e.open("a", F0, seed=1)
        e.open("b", F0, seed=2)
        e.submit(_unit("b", 0, 2))
    eng.submit(_unit("a", 0, 3))
    eng.submit(_unit("a", 1, 3))
    f1 = Fence(1, 1)
    res = eng.cancel("a", F0, f1)
    assert res.dropped_units == (0, 1) and not res.noop
    assert eng.cancel("a", F0, f1).noop  # F-2: a late cancel is a no-op
    with pytest.raises(StaleFenceError):
        eng.cancel("a", F0, Fence(1, 3))  # F-1: next_fence must be epoch + 1
    with pytest.raises(StaleFenceError):
        eng.submit(_unit("a", 2, 3))  # the old epoch is rejected forever
    assert _run(eng) == _run(ref)  # b is untouched, a produced nothing
    assert eng.sessions["a"].tts_pos == 0
    # a's generator was never advanced: its next unit (new epoch) equals a fresh session's first unit
    eng.submit(_unit("a", 3, 3, fence=f1))
    ref.submit(_unit("a", 3, 3, fence=F0))
    (x,), (y,) = _run(eng), _run(ref)
    assert x.codes == y.codes


def test_close_releases_slot_and_stale_close_is_noop() -> None:
    engine = TTSEngine(tiny_model(), _cfg(max_sessions=1))
    engine.open("a", F0, seed=1)
    assert not engine.close("a", Fence(2, 0))
    assert engine.close("a", F0) and engine.slots.free == 1
    engine.open("b", F0, seed=1)
    with pytest.raises(UnknownSessionError):
        engine.submit(_unit("a", 0, 1))


def test_step_on_fresh_state_feeds_valid_codes() -> None:
    """Graph warm-up runs the step on a never-loaded state: every fed code must be in range."""
    engine = TTSEngine(tiny_model(), _cfg())
    runner = engine.runner
    st = runner._state(2)
    with torch.inference_mode():
        runner._step(st, 64)
    assert int(st.t) == 2 and bool((st.samples[:, 16 + 1] < 6562).all())


def test_prefill_on_padded_stale_state_stays_in_range() -> None:
    """A capture reuses a bucket's state after real units: padding must reset every row index."""
    engine = TTSEngine(tiny_model(), _cfg())
    runner = engine.runner
    st = runner._state(2)
    st.load(start=[40, 3], n_rows=[12, 5], slots=[0, 1], eos_allowed=[False, True],
            u=torch.rand(2, 26, dtype=torch.float64), scratch=runner.kv.scratch)
    st.make_padding(runner.kv.scratch)
    with torch.inference_mode():
        runner._prefill(torch.zeros(2, 8, 64), st, 64)  # 8 rows < the stale n = 12
    assert bool((st.slot == runner.kv.scratch).all()) and not bool(st.valid.any())
