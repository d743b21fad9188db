"""The TTS bridge with `engine_options.tts.continuous`: units of several sessions in flight at once keep their
requests open until their codes are out, and the events equal those of units run whole (tiny checkpoint)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_repository.common import bridges
from model_repository.common.settings import ConfigError
from tests.triton.test_bridges import WAIT_S, Sink, send, settings

K = 3
SESSIONS = (41, 42, 43)


@pytest.fixture(scope="module")
def ttses(tiny_checkpoint: Path) -> Iterator[dict[str, Any]]:
    made = {"whole": bridges.tts(settings("tts", tiny_checkpoint, engine_options=f'{{"first_codes": {K}}}')),
            "lanes": bridges.tts(settings("tts", tiny_checkpoint,
                                          engine_options=f'{{"first_codes": {K}, "continuous": true}}'))}
    for bridge in made.values():
        bridge.start()
    yield made
    for bridge in made.values():
        bridge.stop()


def _units_at_once(tts: Any) -> dict[int, list[Sink]]:
    """Each session's turn-start unit and a second unit, every append sent before any is answered."""
    for c in SESSIONS:
        send(tts, corrid=c, op="open", fence=(1, 1, 0), config={"seed": c})
    sinks: dict[int, list[Sink]] = {c: [] for c in SESSIONS}
    for unit, rows in enumerate((4, 2)):
        for c in SESSIONS:
            hidden = np.random.default_rng(10 * c + unit).standard_normal(rows * tts.llm_dim).astype(np.float32)
            sinks[c].append(send(tts, wait=False, corrid=c, op="append", fence=(1, 1, 1), tokens=np.arange(rows),
                                 hidden=hidden, config={"unit": unit, "is_turn_eos": [False] * rows,
                                                        "turn_start": unit == 0}))
    for c in SESSIONS:
        for sink in sinks[c]:
            assert sink.done.wait(WAIT_S)
        send(tts, corrid=c, op="close", fence=(1, 1, 0))
    return sinks


def test_units_in_flight_answer_as_units_run_whole(ttses: dict[str, Any]) -> None:
    got, want = _units_at_once(ttses["lanes"]), _units_at_once(ttses["whole"])
    for c in SESSIONS:
        for mine, theirs in zip(got[c], want[c], strict=True):
            assert mine.closes == 1 and mine.kinds() == theirs.kinds()
            assert [o.event for o in mine.outs] == [o.event for o in theirs.outs]
            for a, b in zip(mine.outs, theirs.outs, strict=True):
                np.testing.assert_array_equal(a.tokens, b.tokens)
        assert not any(o.event.get("dropped") for s in got[c] for o in s.outs)
    heads = [c for c in SESSIONS if [o.event.get("part") for o in got[c][0].outs] == ["head", "rest"]]
    assert heads, {c: [o.event for o in got[c][0].outs] for c in SESSIONS}  # a turn's first unit: head, then rest


def test_continuous_option_is_checked_at_load(tiny_checkpoint: Path) -> None:
    for bad in ("1", '"yes"', "null"):
        with pytest.raises(ConfigError, match="continuous"):
            bridges.tts(settings("tts", tiny_checkpoint, engine_options=f'{{"continuous": {bad}}}'))
    for options, on in (("{}", False), ('{"continuous": true}', True)):
        assert bridges.tts(settings("tts", tiny_checkpoint, engine_options=options)).engine.cfg.continuous is on


def test_a_unit_fenced_off_in_flight_still_closes_its_request(ttses: dict[str, Any]) -> None:
    """A cancel while the unit runs in its lane (its head is out, so it is part way): the unit finishes there, its
    other codes are not sent, and its request ends as dropped, once; the session goes on."""
    tts, c = ttses["lanes"], 51
    send(tts, corrid=c, op="open", fence=(1, 1, 0), config={"seed": 2})
    rows = 3
    hidden = np.random.default_rng(c).standard_normal(rows * tts.llm_dim).astype(np.float32)
    unit = send(tts, wait=False, corrid=c, op="append", fence=(1, 1, 1), tokens=np.arange(rows), hidden=hidden,
                config={"unit": 0, "is_turn_eos": [False] * rows, "turn_start": True})
    deadline = time.monotonic() + WAIT_S
    while not unit.outs and time.monotonic() < deadline:
        time.sleep(0.001)
    assert unit.outs and unit.outs[0].event["part"] == "head" and not unit.closes  # in flight now
    send(tts, corrid=c, op="cancel", fence=(1, 1, 1), next_fence=(1, 2, 1))
    assert unit.done.wait(WAIT_S) and unit.closes == 1
    head, end = unit.outs
    assert end.event.get("dropped") and end.tokens.size == 0, end.event
    again = send(tts, corrid=c, op="append", fence=(1, 2, 2), tokens=np.arange(rows), hidden=hidden,
                 config={"unit": 1, "is_turn_eos": [False] * rows})
    assert again.closes == 1 and again.outs[0].event["type"] == "audio_tokens" and again.outs[0].tokens.size > 0
    send(tts, corrid=c, op="close", fence=(1, 2, 0))
