"""Q11 (model.md §3.7, §5.1-§5.3): a speak unit with zero TTS rows still runs the TTS, from `audio_bos` alone.

Stage0 decided speak and the very next sampled token ended the unit, so the unit has no (t_i, h_i) rows. The
reference still builds the condition `[emb_text(audio_bos)]` (n = 0), generates the unit's codes, and moves the
turn position by 0 + 1 + codes. Checked against the HF-Llama oracle of tests/engine/test_tts_helpers.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.stage1.config import TTSEngineConfig
from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import Fence, TTSUnitRequest, TTSUnitResult
from tests.engine.test_tts_helpers import TINY, OracleSession, offline_condition, tiny_model, with_eos_bias

F0 = Fence(incarnation=1, epoch=0)
LLM_DIM = TINY["llm_dim"]
EOS_BIAS = 12.0  # EOS the likely sample wherever it is allowed
SEED = 5


def _cfg(**kw: object) -> TTSEngineConfig:
    base = dict(max_sessions=4, max_batch=4, max_turn_positions=512, min_kv_bucket=64)
    return TTSEngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _unit(sid: str, idx: int, n: int, *, end: bool = False, start: bool = False) -> TTSUnitRequest:
    g = torch.Generator().manual_seed(7919 * idx + n)
    ids = tuple(int(x) for x in torch.randint(0, TINY["num_text_tokens"] - 3, (n,), generator=g))
    return TTSUnitRequest(session_id=sid, fence=F0, unit_index=idx, text_ids=ids,
                          hidden=torch.randn(n, LLM_DIM, generator=g), is_turn_eos=(False,) * n,
                          end_of_turn=end, turn_start=start)


def _run(engine: TTSEngine) -> list[TTSUnitResult]:
    out: list[TTSUnitResult] = []
    while engine.pending():
        out.extend(engine.step())
    return out


def test_zero_row_condition_is_audio_bos_alone() -> None:
    """§5.1 with n = 0: the condition is the single row emb_text(audio_bos), also when batched with a longer unit."""
    model = tiny_model()
    engine = TTSEngine(model, _cfg())
    for sid, n in (("a", 0), ("b", 3)):
        engine.open(sid, F0, seed=SEED)
        engine.submit(_unit(sid, 0, n, start=True))
    work = engine._collect()
    with torch.inference_mode():
        cond = engine._condition_rows(work)  # [2, 4, H]
    bos = model.emb_text.weight[model.cfg.audio_bos_token_id]
    ref = offline_condition(model, [], torch.zeros(0, LLM_DIM))
    assert ref.shape == (1, model.cfg.hidden_size)
    torch.testing.assert_close(ref[0], bos)
    torch.testing.assert_close(cond[0, 0], bos)  # row 0 of the empty unit is audio_bos
    req = work[1].req
    torch.testing.assert_close(cond[1], offline_condition(model, list(req.text_ids), req.hidden), atol=1e-5, rtol=1e-5)


# (rows, end_of_turn) per unit; the zero-row unit opens a turn, sits inside one, closes one, or is a turn alone
SCRIPTS = {
    "opens_turn": [(0, False), (2, False), (1, True)],
    "mid_turn": [(3, False), (0, False), (2, True)],
    "ends_turn": [(2, False), (0, True), (1, False)],
    "whole_turn": [(0, True), (0, False), (0, False)],
}


@pytest.mark.parametrize("eos_bias", [0.0, EOS_BIAS])
@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_zero_row_unit_runs_the_tts_as_the_reference(script: list[tuple[int, bool]], eos_bias: float) -> None:
    """Codes equal the reference loop's; the turn advances by n + 1 + codes (n = 0 included); draws are committed;
    the KV the turn keeps is the reference's."""
    model = tiny_model()
    oracle = OracleSession(model, seed=SEED, eos_bias=eos_bias)
    if eos_bias:
        with_eos_bias(model, eos_bias)
    engine = TTSEngine(model, _cfg())
    engine.open("a", F0, seed=SEED)
    pos, draws = 0, 0
    for i, (n, end) in enumerate(script):
        req = _unit("a", i, n, end=end, start=pos == 0)
        engine.submit(req)
        (res,) = _run(engine)
        assert list(res.codes) == oracle.unit(list(req.text_ids), req.hidden, end), i
        assert res.start_pos == pos and res.end_pos == pos + n + 1 + len(res.codes), i
        assert res.draws == (len(res.codes) + 1 if res.eos else 26) and res.turn_closed == end, i
        if pos > 0 and not end:  # mid-turn: EOS masked, the unit is a full second (§5.3), rows or none
            assert len(res.codes) == 25 and not res.eos, i
        pos, draws = (0 if end else res.end_pos), draws + res.draws
        assert engine.sessions["a"].tts_pos == pos == oracle.pos, i
    fresh = torch.Generator().manual_seed(SEED + 1)  # the session's TTS generator advanced by exactly its draws
    torch.rand(draws, dtype=torch.float64, generator=fresh)
    assert torch.equal(fresh.get_state(), engine.sessions["a"].generator.get_state())
    if pos:
        keys = engine.runner.kv.k[0][engine.sessions["a"].slot, :, :pos]
        torch.testing.assert_close(keys, oracle.cache.layers[0].keys[0], atol=1e-5, rtol=1e-5)


def test_zero_row_units_batched_equal_solo() -> None:
    """Ragged batches with empty units (pad rows past audio_bos) give each session its solo codes."""
    model = tiny_model()
    plan = {"a": [(0, False), (0, False)], "b": [(4, False), (0, True)], "c": [(0, False), (5, False)]}

    def results(max_batch: int) -> list[TTSUnitResult]:
        engine = TTSEngine(model, _cfg(max_batch=max_batch))
        for sid in plan:
            engine.open(sid, F0, seed=SEED)
        out: list[TTSUnitResult] = []
        for i in range(2):
            for sid, units in plan.items():
                n, end = units[i]
                engine.submit(_unit(sid, i, n, end=end))
            out += _run(engine)
        return sorted(out, key=lambda r: (r.session_id, r.unit_index))

    batched, solo = results(3), results(1)
    assert batched == solo
    assert all(r.codes for r in batched)
