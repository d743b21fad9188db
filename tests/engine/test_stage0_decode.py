"""Decode rules of one unit (model.md §3.4, I11) driven by scripted sampled ids."""

from __future__ import annotations

from engine.stage0.config import DecodeRules
from engine.stage0.decode import Feed, Stop, TurnState, UnitDecoder
from tests.engine.test_stage0_helpers import tiny_ids, tiny_tokenizer

TOK = tiny_tokenizer()
IDS = tiny_ids()


def run(script: list[int], turn: TurnState, rules: DecodeRules = DecodeRules(force_listen_count=0),  # noqa: B008 - frozen
        override: bool = False) -> tuple[UnitDecoder, list[int], list[bool]]:
    """Feeds the script as sampled ids; returns the decoder, the fed ids and whether each step sampled."""
    dec = UnitDecoder(IDS, rules, turn, TOK.decode, force_listen_override=override)
    fed, sampled = [], []
    if dec.close_turn_first:
        fed.append(IDS.turn_eos)
        dec.turn_closed()
    it = iter(script)
    while not dec.done:
        need = dec.needs_sample()
        sampled.append(need)
        action = dec.step(next(it) if need else None)
        if isinstance(action, Feed):
            fed.append(action.token)
            dec.fed(action.token, hidden=None)
    return dec, fed, sampled


def text_ids(s: str) -> list[int]:
    return TOK.encode(s)


def test_listen_and_speak_units() -> None:
    turn = TurnState()
    dec, fed, _ = run([IDS.listen], turn)
    assert fed == [] and dec.is_listen and dec.terminator == IDS.listen and turn.current_turn_ended
    dec, fed, _ = run([IDS.speak, *text_ids("Hi"), IDS.chunk_eos], turn)
    assert fed == [IDS.speak, *text_ids("Hi")] and not dec.is_listen and dec.text == "Hi"
    assert [r.token_id for r in dec.rows] == text_ids("Hi")  # j = 0 is never a row
    assert not turn.current_turn_ended and dec.decision == IDS.speak


def test_midturn_listen_becomes_tts_bos_and_turn_eos() -> None:
    turn = TurnState(current_turn_ended=False)
    dec, fed, _ = run([IDS.listen, *text_ids("ok"), IDS.turn_eos, IDS.listen], turn)
    assert fed == [IDS.tts_bos, *text_ids("ok"), IDS.turn_eos]
    assert dec.is_listen and dec.end_of_turn and turn.current_turn_ended  # Q12: ends on <|listen|>
    assert dec.rows[-1].is_turn_eos and dec.rows[-1].token_id == IDS.turn_eos
    turn = TurnState(current_turn_ended=False)
    dec, fed, _ = run([IDS.listen, IDS.chunk_eos], turn, DecodeRules(force_listen_count=0, midturn_listen="allow"))
    assert fed == [] and dec.is_listen


def test_force_listen_count_and_override() -> None:
    turn = TurnState()
    rules = DecodeRules(force_listen_count=2)
    for _ in range(2):
        dec, fed, sampled = run([], turn, rules)
        assert fed == [] and sampled == [False] and dec.terminator == IDS.listen
    dec, _, sampled = run([IDS.listen], turn, rules)
    assert sampled == [True] and turn.units_generated == 3
    turn = TurnState(current_turn_ended=False)
    dec, fed, sampled = run([], turn, override=True)
    assert fed == [IDS.turn_eos] and dec.rows == [] and dec.terminator == IDS.listen and sampled == [False]
    assert turn.current_turn_ended
    dec, fed, _ = run([], TurnState(), override=True)  # turn already closed: no `<|turn_eos|>`
    assert fed == []


def test_twenty_step_cap_feeds_at_most_eighteen_text_tokens() -> None:
    rules = DecodeRules(force_listen_count=0, max_speak_chars_per_unit=0)
    dec, fed, sampled = run([IDS.speak] + text_ids("a" * 40), TurnState(), rules)
    assert len(fed) == 19 and len(dec.rows) == 18 and dec.terminator == IDS.chunk_eos
    assert sampled[-1] is False and len(sampled) == 20


def test_character_cap_rejects_token() -> None:
    # byte tokens are one character each, so the step cap is raised to let 28 characters fit
    script = [IDS.speak, *text_ids("abcdefghij" * 2), IDS.turn_eos, *text_ids("klmnopqrstuv")]
    dec = UnitDecoder(IDS, DecodeRules(force_listen_count=0, max_steps=40), TurnState(), TOK.decode)
    it, last = iter(script), None
    while not dec.done:
        action = dec.step(next(it))
        if isinstance(action, Feed):
            dec.fed(action.token, None)
        last = action
    assert isinstance(last, Stop) and last.terminator == IDS.chunk_eos
    assert last.rejected == text_ids("r")[0]  # the 28th character; specials count 0
    assert len(dec.text) == 27 and IDS.turn_eos in dec.unit_ids


def test_first_token_terminator_gives_empty_speak_unit() -> None:
    dec, fed, _ = run([IDS.chunk_tts_eos], TurnState())
    assert fed == [] and not dec.is_listen and dec.rows == [] and dec.terminator == IDS.chunk_tts_eos
