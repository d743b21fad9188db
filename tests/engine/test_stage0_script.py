"""`scripted_decisions` (model.md §9.5): benchmark-only, the default script, kernels still run."""

from __future__ import annotations

import dataclasses

import pytest

from engine.stage0 import Fence, Stage0Config, TokenEvent, UnitDone
from engine.stage0.script import DecisionScript, ScriptPlan
from tests.engine.test_stage0_engine import make_engine, params
from tests.engine.test_stage0_helpers import TINY, tiny_ids, tiny_tokenizer, unit_pcm


def test_production_config_rejects_scripted_decisions() -> None:
    with pytest.raises(ValueError, match="benchmark"):
        Stage0Config(scripted_decisions=True)
    assert Stage0Config(scripted_decisions=True, benchmark_mode=True).scripted_decisions
    assert not Stage0Config().scripted_decisions


def test_default_script_drives_the_engine() -> None:
    engine, events = make_engine(scripted_decisions=True, benchmark_mode=True)
    assert engine.script is not None
    ids, plan = engine.ids, ScriptPlan()
    engine.open("a", Fence(1, 0), params=params(7))
    units = plan.cycle + 1
    for k in range(units):
        engine.append("a", Fence(1, 0, seq=k), unit_pcm(2, k))
        engine.run_until_idle()
    done = [e for e in events if isinstance(e, UnitDone)]
    assert [d.unit_index for d in done] == list(range(units))
    speak = range(plan.listen_units, plan.listen_units + plan.speak_units)
    for d in done:
        toks = [e for e in events if isinstance(e, TokenEvent) and e.unit_index == d.unit_index]
        assert toks[0].decision
        if d.unit_index not in speak:
            assert d.is_listen and d.terminator == ids.listen and toks[0].token_id == ids.listen and not d.rows
            continue
        last = d.unit_index == speak[-1]
        assert not d.is_listen and d.terminator == ids.chunk_eos and toks[0].token_id == ids.speak
        row_ids = [r.token_id for r in d.rows]
        text = row_ids[:plan.text_ids_per_unit]
        assert len(text) == plan.text_ids_per_unit and all(engine.script.is_text(t) for t in text)
        assert row_ids[plan.text_ids_per_unit:] == ([ids.turn_eos] if last else [])
        assert d.end_of_turn == last and all(r.hidden is not None for r in d.rows)
        assert d.text == tiny_tokenizer().decode(text)
    s = engine.session("a")
    # every step still sampled: the session's uniforms were drawn and Step-B ids joined the history
    assert s.stream.consumed > 0 and s.history
    assert s.turn.current_turn_ended


def test_script_is_reproducible_and_uses_text_ids() -> None:
    tok, special = tiny_tokenizer(), tiny_ids()
    a, b = (DecisionScript(special, tok.decode, TINY.vocab_size) for _ in range(2))
    plan = a.plan
    first_speak = plan.listen_units
    assert a.unit(3, first_speak) == b.unit(3, first_speak)
    assert a.unit(3, first_speak) != a.unit(4, first_speak)
    assert a.unit(3, 0) == (special.listen,)
    named = {v for v in dataclasses.asdict(special).values() if isinstance(v, int)}
    for token in a.unit(3, first_speak)[1:-1]:
        assert token not in named and token not in special.bad_token_ids and tok.decode([token])
    assert a.choose(3, first_speak, 99, sampled=5) == special.chunk_eos  # past the script: close
