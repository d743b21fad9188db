"""A unit in two parts (head, rest): the head of a turn's first unit renders its first audio alone, the
unit keeps its sample count, mid-turn heads only buffer (render, with `head_every_unit`), short rests pad after
their audio, errors and cancels (stream.py `plan_head` / `plan_rest`, token2wav_engine.py `submit(part=...)`)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.stage1.token2wav_engine import (
    StaleFenceError,
    Token2WavEngine,
    Token2WavEngineConfig,
    UnitPartError,
)
from engine.stage1.types import Fence
from engine.token2wav.assets import TINY_HIFT
from engine.token2wav.config import StreamConfig
from engine.token2wav.stream import StreamInputError, new_session
from engine.token2wav.voice import build_voice_cache
from tests.engine import test_token2wav_engine as whole_unit_tests
from tests.engine.test_token2wav_engine import drain, make_engine, per_unit
from tests.engine.test_token2wav_stream import N_TS, codes, make_voice

F0 = Fence(1, 0)
UNIT_CODES = 24                 # the TTS's unit: one code short of the steady 25, so a whole unit is padded
SPF = TINY_HIFT.samples_per_frame
LEAD_IN = 8 * SPF               # a turn's first call starts with 160 ms of zeros (§6.5 step 7)
WHOLE_PAD = 24000 - 2 * UNIT_CODES * SPF    # 960: the §6.6 left pad of a whole 24-code first unit


models = whole_unit_tests.models  # the same tiny models fixture as the whole-unit engine tests


def opened(models, **kw) -> Token2WavEngine:
    eng = make_engine(models, **kw)
    eng.open("s", F0, "a", 0)
    return eng


def submit_parts(eng: Token2WavEngine, unit: int, unit_list: list[int], k: int, end_of_turn: bool = False
                 ) -> tuple[int, int]:
    """Head (k codes) then rest; the head announces a full unit (UNIT_CODES) whatever the rest brings."""
    head = eng.submit("s", F0, unit, unit_list[:k], False, part="head", unit_codes=UNIT_CODES)
    rest = eng.submit("s", F0, unit, unit_list[k:], end_of_turn, part="rest")
    return head, rest


# ---------------------------------------------------------------------------- the plan (SessionStream)
def test_head_plan_pads_as_the_whole_unit_and_keeps_the_look_ahead(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    ses = new_session(models, build_voice_cache(models.flow, make_voice(1), scfg), scfg, seed=0)
    unit = codes(1, UNIT_CODES)
    head = ses.plan_head(unit[:12], UNIT_CODES)
    assert head.pad == WHOLE_PAD and not head.pad_after and head.samples == 2 * 12 * SPF
    assert [c.tokens for c in head.calls] == [[scfg.silence_code] * 3 + unit[:12]]
    assert ses.buffer == unit[9:12] and ses.turn_units == 0 and ses.plan_mel == 8   # the dry run left no trace
    rest = ses.plan_rest(unit[12:], False)
    assert [c.tokens for c in rest.calls] == [unit[9:]] and rest.pad == 0 and ses.turn_units == 1
    for unit_codes in (None, 12, 5):            # unknown, or not larger than the head: no pad
        ses.reset_plan()
        assert ses.plan_head(unit[:12], unit_codes).pad == 0
    ses.reset_plan()
    long = ses.plan_head(codes(2, 30), None)    # one call adds at most chunk_call codes
    assert [len(c.tokens) for c in long.calls] == [scfg.chunk_call] and len(ses.buffer) == 3 + 5
    ses.reset_plan()
    assert ses.plan_head(unit[:1], UNIT_CODES).calls == []    # below min_call: only buffered
    with pytest.raises(StreamInputError):
        ses.plan_head(unit[1:3], UNIT_CODES)
    ses.reset_plan()
    with pytest.raises(StreamInputError):
        ses.plan_rest(unit, False)


# ---------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("k", [12, 21])
def test_head_renders_alone_and_the_unit_keeps_its_count(models, ragged, k):
    whole, parts = opened(models, ragged=ragged), opened(models, ragged=ragged)
    units = [codes(10 + u, UNIT_CODES) for u in range(3)]
    for u, unit in enumerate(units):
        assert whole.submit("s", F0, u, unit, False) == 24000
    assert parts.submit("s", F0, 0, units[0][:k], False, part="head", unit_codes=UNIT_CODES) \
        == WHOLE_PAD + 2 * k * SPF
    head = drain(parts)                     # the head's audio, with nothing of the rest submitted yet
    assert [c.pcm.shape[0] for c in head] == [WHOLE_PAD, 2 * k * SPF]
    assert not head[0].pcm.any() and not head[1].pcm[:LEAD_IN].any() and head[1].pcm[LEAD_IN:].any()
    assert [(c.part_final, c.unit_final) for c in head] == [(False, False), (True, False)]
    rest = parts.submit("s", F0, 0, units[0][k:], False, part="rest")
    assert WHOLE_PAD + 2 * k * SPF + rest == 24000
    for u in (1, 2):
        assert parts.submit("s", F0, u, units[u], False) == 24000
    tail = drain(parts)
    assert [(c.part_final, c.unit_final) for c in tail if c.unit_index == 0][-1] == (True, True)
    got, want = per_unit(head + tail, "s"), per_unit(drain(whole), "s")
    assert [got[u].shape for u in range(3)] == [want[u].shape for u in range(3)] == [(24000,)] * 3
    assert not np.array_equal(got[0], want[0])       # other chunking, other audio (as with first_hop)
    assert got[0][WHOLE_PAD + LEAD_IN:].any()


def test_mid_turn_head_only_buffers(models):
    whole, parts = opened(models), opened(models)
    units = [codes(20 + u, UNIT_CODES) for u in range(3)]
    for u, unit in enumerate(units):
        whole.submit("s", F0, u, unit, u == 2)
    parts.submit("s", F0, 0, units[0], False)
    stream = parts.sessions["s"].stream
    assert parts.submit("s", F0, 1, units[1][:6], False, part="head", unit_codes=UNIT_CODES) == 0
    assert stream.buffer[-6:] == units[1][:6] and stream.turn_units == 1
    out = drain(parts)
    marker = [c for c in out if c.unit_index == 1]
    assert [(c.pcm.size, c.part_final, c.unit_final) for c in marker] == [(0, True, False)]
    assert parts.submit("s", F0, 1, units[1][6:], False, part="rest") == 24000
    parts.submit("s", F0, 2, units[2], True)
    got, want = per_unit(out + drain(parts), "s"), per_unit(drain(whole), "s")
    for u in range(3):                       # the whole unit's plan: the same audio, left pad included
        np.testing.assert_array_equal(got[u], want[u])


def every_unit_engine(models, ragged: bool = True) -> Token2WavEngine:
    eng = Token2WavEngine(models, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), ragged=ragged,
                                                        head_codes=8, head_every_unit=True))
    eng.add_voice("a", make_voice(1))
    eng.open("s", F0, "a", 0)
    return eng


@pytest.mark.parametrize("ragged", [True, False])
def test_head_every_unit_renders_mid_turn_heads_at_once(models, ragged):
    """The TTS's `head_every_unit`: a mid-turn head makes its own call (the 3 look-ahead codes + the head) before
    the rest comes, and each unit keeps its second of audio."""
    eng, whole = every_unit_engine(models, ragged), opened(models, ragged=ragged)
    chunk = eng.cfg.stream.chunk_new                      # 25: the steady unit, no pad
    units = [codes(60 + u, chunk) for u in range(3)]
    for u, unit in enumerate(units):
        whole.submit("s", F0, u, unit, u == 2)
    out = []
    for u, unit in enumerate(units):
        stream = eng.sessions["s"].stream
        look_ahead = list(stream.buffer)
        head = eng.submit("s", F0, u, unit[:8], False, part="head", unit_codes=chunk)
        if u:
            assert head == 2 * 8 * SPF and stream.buffer == unit[5:8]   # one call of 3 + 8, 3 codes kept
            assert look_ahead == units[u - 1][-3:]
        got = drain(eng)                                   # the head's audio, before its rest is submitted
        assert got and got[-1].part_final and not got[-1].unit_final and got[-1].pcm[-SPF:].any()
        rest = eng.submit("s", F0, u, unit[8:], u == 2, part="rest")
        if u < 2:
            assert head + rest == 24000
        out += got + drain(eng)
    mine, want = per_unit(out, "s"), per_unit(drain(whole), "s")
    assert [mine[u].shape for u in range(3)] == [want[u].shape for u in range(3)]
    assert [mine[u].shape[0] for u in range(2)] == [24000, 24000]
    assert not np.array_equal(mine[1], want[1])       # other chunking, other audio (as the first unit's head)


def test_head_every_unit_needs_a_head_size_and_the_always_flush(models):
    for kw in ({"head_every_unit": True}, {"head_every_unit": True, "head_codes": 8,
                                           "stream": StreamConfig(force_flush="turn_start")}):
        with pytest.raises(ValueError, match="head_every_unit"):
            Token2WavEngineConfig(**kw)


def test_short_rest_pads_after_its_audio(models):
    eng = opened(models)
    unit = codes(30, 18)                     # the TTS stopped short of its 24 codes (not end of turn)
    head, rest = submit_parts(eng, 0, unit, 12)
    assert head == WHOLE_PAD + 12 * 2 * SPF and rest == 24000 - head
    chunks = drain(eng)
    tail = chunks[2:]
    rest_audio = 2 * 6 * SPF                 # buffer 3 look-ahead + 6 → one call of 9
    assert [c.pcm.size for c in tail] == [rest_audio, rest - rest_audio]
    assert tail[0].pcm.any() and not tail[1].pcm.any() and tail[1].unit_final and tail[1].part_final
    assert not tail[0].part_final
    plan_eng = opened(models)
    ses = plan_eng.sessions["s"].stream
    ses.plan_head(unit[:12], UNIT_CODES)
    assert ses.plan_rest(unit[12:], False).pad_after


def test_end_of_turn_rest_does_not_pad(models):
    eng = opened(models)
    unit = codes(31, 18)
    head, rest = submit_parts(eng, 0, unit, 12, end_of_turn=True)
    # rest: one call of 9 (6 new), then the last call of the 3 look-ahead codes with the 8 kept mel frames
    assert rest == 2 * 6 * SPF + (8 + 2 * 3) * SPF
    chunks = drain(eng)
    assert [c.pcm.size for c in chunks] == [WHOLE_PAD, 12 * 2 * SPF, 2 * 6 * SPF, (8 + 2 * 3) * SPF]
    assert chunks[-1].pcm.any() and chunks[-1].unit_final and chunks[-1].end_of_turn
    ses = eng.sessions["s"].stream
    assert ses.turn_units == 0 and ses.head is None and ses.buffer == [ses.scfg.silence_code] * 3
    assert eng.submit("s", F0, 1, codes(32, 12), False, part="head", unit_codes=UNIT_CODES) > 0   # a new turn


def test_part_errors_change_nothing(models):
    eng = opened(models)
    unit = codes(40, UNIT_CODES)
    eng.submit("s", F0, 0, unit[:8], False, part="head", unit_codes=UNIT_CODES)
    ses = eng.sessions["s"].stream
    before = (list(ses.buffer), ses.turn_units, ses.plan_mel, ses.head, eng.pending())
    for index, part in ((0, "head"), (0, "middle"), (0, None), (1, "rest")):
        with pytest.raises(UnitPartError):   # a second head, a bad part, another unit while a head waits
            eng.submit("s", F0, index, unit[8:], False, part=part)
    assert (list(ses.buffer), ses.turn_units, ses.plan_mel, ses.head, eng.pending()) == before
    other = opened(models)
    with pytest.raises(UnitPartError):
        other.submit("s", F0, 0, unit[:8], True, part="head")    # the rest ends a turn, not the head
    assert isinstance(UnitPartError("x"), ValueError)
    eng.submit("s", F0, 0, unit[8:], False, part="rest")         # the waiting head still takes its rest


def test_cancel_drops_a_units_head_and_rest(models):
    eng = opened(models)
    unit = codes(50, UNIT_CODES)
    submit_parts(eng, 0, unit, 12)
    eng.submit("s", F0, 1, codes(51, UNIT_CODES), False)
    res = eng.cancel("s", F0, Fence(1, 1))
    assert res.dropped_units == (0, 1) and eng.pending() == 0
    # cancelled between the head and its rest: the head's items go, the old rest is stale, a new head is free
    f1, f2 = Fence(1, 1), Fence(1, 2)
    eng.submit("s", f1, 2, unit[:12], False, part="head", unit_codes=UNIT_CODES)
    assert eng.cancel("s", f1, f2).dropped_units == (2,) and eng.pending() == 0
    assert eng.sessions["s"].head_unit is None and eng.sessions["s"].stream.head is None
    with pytest.raises(StaleFenceError):
        eng.submit("s", f1, 2, unit[12:], False, part="rest")
    assert eng.submit("s", f2, 2, unit[12:], False, part="rest") == 24000   # no head in this epoch: a whole unit
    eng.submit("s", f2, 3, unit[:12], False, part="head", unit_codes=UNIT_CODES)
    # a newer epoch drops a waiting head too, without an explicit cancel
    assert eng.submit("s", Fence(1, 3), 4, unit, False) == 24000
    assert {c.unit_index for c in drain(eng)} == {4}


# ---------------------------------------------------------------------------- warm-up with heads
@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("every_unit", [False, True])
def test_a_warm_up_turn_sends_its_first_unit_as_the_tts_does(models, monkeypatch, heads, every_unit):
    """With `head_codes` (the TTS's first_codes) a warm-up turn's first unit (every unit, with `head_every_unit`)
    comes as head and rest, so the served head and rest call shapes are built at warm-up; the other units, and
    turns without heads, come whole."""
    eng = Token2WavEngine(models, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), head_codes=8,
                                                        head_every_unit=every_unit))
    eng.add_voice("a", make_voice(1))
    sent: list[tuple[int, int, str | None, int | None]] = []
    submit = eng.submit

    def spy(sid, fence, unit, unit_codes_, end_of_turn, part=None, unit_codes=None):  # noqa: ANN001, ANN202
        sent.append((unit, len(unit_codes_), part, unit_codes))
        return submit(sid, fence, unit, unit_codes_, end_of_turn, part=part, unit_codes=unit_codes)

    monkeypatch.setattr(eng, "submit", spy)
    eng._warm_turn("a", 2, np.random.default_rng(0), heads=heads)
    chunk = eng.cfg.stream.chunk_new
    def parts(u: int) -> list[tuple[int, int, str | None, int | None]]:
        if heads and (u == 0 or every_unit):
            return [(u, 8, "head", chunk), (u, chunk - 8, "rest", None)]
        return [(u, chunk, None, None)]
    assert sent == [p for u in range(4) for p in parts(u) * 2]
    assert not eng.pending() and not eng.sessions
