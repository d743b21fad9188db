"""The TTS bridge with `engine_options.tts.first_codes`: a turn's first codes as their own `audio_tokens`
event (`part: head`), the unit's other codes after them (`part: rest`), on the seeded tiny checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_repository.common import bridges
from model_repository.common.settings import ConfigError
from tests.triton.test_bridges import Sink, send, settings

K = 3


@pytest.fixture(scope="module")
def ttses(tiny_checkpoint: Path) -> Iterator[dict[str, Any]]:
    made = {"head": bridges.tts(settings("tts", tiny_checkpoint, engine_options=f'{{"first_codes": {K}}}')),
            "whole": bridges.tts(settings("tts", tiny_checkpoint))}
    for bridge in made.values():
        bridge.start()
    yield made
    for bridge in made.values():
        bridge.stop()


def _turn(tts: Any, corrid: int) -> list[Sink]:
    """Two units of one turn (the first starts it), then close."""
    send(tts, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 4})
    rng, llm_dim, sinks = np.random.default_rng(corrid), tts.llm_dim, []
    for unit, rows in enumerate((4, 2)):
        sinks.append(send(tts, corrid=corrid, op="append", fence=(1, 1, unit + 1), tokens=np.arange(rows),
                          hidden=rng.standard_normal(rows * llm_dim).astype(np.float32),
                          config={"unit": unit, "is_turn_eos": [False] * rows, "turn_start": unit == 0}))
    send(tts, corrid=corrid, op="close", fence=(1, 1, 0))
    return sinks


def test_turn_start_unit_goes_out_as_head_then_rest(ttses: dict[str, Any]) -> None:
    (start, mid), (whole_start, whole_mid) = _turn(ttses["head"], 31), _turn(ttses["whole"], 31)
    for sink in (whole_start, whole_mid, mid):  # one event, as without the option
        assert sink.kinds() == ["audio_tokens"] and sink.closes == 1
        assert "part" not in sink.outs[0].event and sink.outs[0].tokens.size == sink.outs[0].event["count"]
    assert mid.outs[0].event == whole_mid.outs[0].event
    np.testing.assert_array_equal(mid.outs[0].tokens, whole_mid.outs[0].tokens)

    assert start.kinds() == ["audio_tokens", "audio_tokens"] and start.closes == 1
    head, rest = start.outs
    unit = whole_start.outs[0]
    assert head.event == {"type": "audio_tokens", "unit": 0, "count": K, "part": "head", "unit_codes": 25}
    assert rest.event == {"type": "audio_tokens", "unit": 0, "count": unit.event["count"] - K, "part": "rest",
                          "eos": unit.event["eos"], "end_of_turn": unit.event["end_of_turn"]}
    assert head.tokens.dtype == rest.tokens.dtype == np.int64 and rest.tokens.size == rest.event["count"]
    np.testing.assert_array_equal(np.concatenate([head.tokens, rest.tokens]), unit.tokens)


def test_first_codes_option_is_checked_at_load(tiny_checkpoint: Path) -> None:
    for bad in ("-1", "25", "true", '"3"', "2.5"):  # 25: a full unit has 25 codes, the rest would be empty
        with pytest.raises(ConfigError, match="first_codes"):
            bridges.tts(settings("tts", tiny_checkpoint, engine_options=f'{{"first_codes": {bad}}}'))
    for options, first in (("{}", 0), ('{"first_codes": 24}', 24)):
        assert bridges.tts(settings("tts", tiny_checkpoint, engine_options=options)).engine.cfg.first_codes == first
    for bad in ('{"head_every_unit": true}', '{"first_codes": 8, "head_every_unit": 1}'):  # no head size; not a bool
        with pytest.raises(ConfigError, match="head_every_unit"):
            bridges.tts(settings("tts", tiny_checkpoint, engine_options=bad))
    every = bridges.tts(settings("tts", tiny_checkpoint, engine_options='{"first_codes": 8, "head_every_unit": true}'))
    assert every.engine.cfg.head_every_unit
