"""The Token2Wav bridge takes a unit in two `append` requests, CONFIG `part` "head" then "rest": the head's
request is answered with its audio and ends, the rest's continues `seq` and carries the unit's `last`; bad
parts are typed `invalid_request` (tests/triton/test_bridges.py's in-process harness)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_repository.common import bridges
from tests.triton.test_bridges import Sink, send, settings

UNIT_CODES = 24
CODES = np.random.default_rng(5).integers(0, 6561, 2 * UNIT_CODES)   # two units' codes
K = 12
_corrids = count(700)


@pytest.fixture(scope="module")
def t2w(tiny_checkpoint: Path) -> Iterator[Any]:
    bridge = bridges.token2wav(settings("token2wav", tiny_checkpoint))
    bridge.start()
    yield bridge
    bridge.stop()


@pytest.fixture
def corrid(t2w: Any) -> Iterator[int]:
    """An open session, closed after the test however it ended (the bridge holds only two)."""
    corrid = next(_corrids)
    assert send(t2w, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 3}).kinds() == ["opened"]
    yield corrid
    assert send(t2w, corrid=corrid, op="close", fence=(1, 1, 0)).kinds() == ["closed"]
    assert str(corrid) not in t2w.seqs


def append(bridge: Any, corrid: int, unit: int, codes: np.ndarray, **config: Any) -> Sink:
    return send(bridge, corrid=corrid, op="append", fence=(1, 1, unit + 1), tokens=codes,
                config={"unit": unit, "end_of_turn": False, **config})


def samples(sink: Sink) -> int:
    return sum(o.event["samples"] for o in sink.outs)


def test_head_then_rest(t2w: Any, corrid: int) -> None:
    head = append(t2w, corrid, 0, CODES[:K], part="head", unit_codes=UNIT_CODES)
    assert head.closes == 1 and set(head.kinds()) == {"audio"}   # answered before the rest was sent
    assert [o.event["seq"] for o in head.outs] == list(range(len(head.outs)))
    assert [o.event["last"] for o in head.outs] == [False] * len(head.outs)
    rest = append(t2w, corrid, 0, CODES[K:UNIT_CODES], part="rest")
    assert rest.closes == 1 and set(rest.kinds()) == {"audio"}
    assert [o.event["seq"] for o in rest.outs] == list(range(len(head.outs), len(head.outs) + len(rest.outs)))
    assert [o.event["last"] for o in rest.outs] == [False] * (len(rest.outs) - 1) + [True]
    assert samples(head) + samples(rest) == 24_000
    nxt = append(t2w, corrid, 1, CODES[UNIT_CODES:])          # a whole unit after it: seq starts over
    assert [o.event["seq"] for o in nxt.outs] == list(range(len(nxt.outs))) and samples(nxt) == 24_000
    assert not t2w.seqs.get(str(corrid))                      # every unit's counter ended with it


@pytest.mark.parametrize("config", [{"part": "middle"}, {"part": "head", "unit_codes": 0},
                                    {"part": "head", "unit_codes": "24"}, {"part": "head", "unit_codes": True}])
def test_bad_part_is_invalid_request(t2w: Any, corrid: int, config: dict[str, Any]) -> None:
    sink = append(t2w, corrid, 0, CODES[:K], **config)
    assert [o.event.get("code") for o in sink.outs] == ["invalid_request"] and sink.closes == 1


def test_second_head_is_invalid_request(t2w: Any, corrid: int) -> None:
    append(t2w, corrid, 0, CODES[:K], part="head", unit_codes=UNIT_CODES)
    again = append(t2w, corrid, 0, CODES[K:UNIT_CODES], part="head", unit_codes=UNIT_CODES)
    assert [o.event.get("code") for o in again.outs] == ["invalid_request"] and again.closes == 1
    rest = append(t2w, corrid, 0, CODES[K:UNIT_CODES], part="rest")     # the waiting head still takes its rest
    assert rest.outs[-1].event["last"] and samples(rest) > 0


@pytest.mark.parametrize("value", [-1, True, "8", 2.5])
def test_a_bad_head_codes_option_fails_the_load(tiny_checkpoint: Path, value: Any) -> None:
    from model_repository.common.settings import ConfigError

    with pytest.raises(ConfigError, match="head_codes"):
        bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options=f'{{"head_codes": {json.dumps(value)}}}'))


def test_head_codes_reach_the_engine(tiny_checkpoint: Path) -> None:
    bridge = bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options='{"head_codes": 8}'))
    assert bridge.engine.cfg.head_codes == 8 and not bridge.engine.cfg.head_every_unit
    every = bridges.token2wav(settings("token2wav", tiny_checkpoint,
                                       engine_options='{"head_codes": 8, "head_every_unit": true}'))
    assert every.engine.cfg.head_every_unit and every.engine.cfg.max_graphs > bridge.engine.cfg.max_graphs


@pytest.mark.parametrize("options", ['{"head_every_unit": true}', '{"head_codes": 8, "head_every_unit": "yes"}'])
def test_a_bad_head_every_unit_option_fails_the_load(tiny_checkpoint: Path, options: str) -> None:
    from model_repository.common.settings import ConfigError

    with pytest.raises(ConfigError, match="head_every_unit"):
        bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options=options))


@pytest.mark.parametrize("name", ["compile_flow", "compile_hift"])
@pytest.mark.parametrize("value", [1, "true", None])
def test_a_bad_compile_option_fails_the_load(tiny_checkpoint: Path, name: str, value: Any) -> None:
    from model_repository.common.settings import ConfigError

    with pytest.raises(ConfigError, match=name):
        bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options=json.dumps({name: value})))


def test_compile_options_reach_the_flow_and_the_hift(tiny_checkpoint: Path) -> None:
    from engine.model.layers import run_layer
    from engine.token2wav.hift import snake
    from tests.engine.test_token2wav_compile import snake_fn

    for options, flow, hift in (("{}", False, False), ('{"compile_flow": true}', True, False),
                                ('{"compile_hift": true}', False, True)):
        bridge = bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options=options))
        assert (bridge.engine.cfg.compile_flow, bridge.engine.cfg.compile_hift) == (flow, hift)
        assert (bridge.engine.models.flow.decoder.estimator.block_fn is not run_layer) is flow
        assert (bridge.engine.models.flow.encoder.block_fn is not run_layer) is flow
        assert (snake_fn(bridge.engine.models.hift) is not snake) is hift


def test_tile_rows_reach_the_engine(tiny_checkpoint: Path) -> None:
    bridge = bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options='{"tile_rows": 2}'))
    assert bridge.engine.cfg.tile_rows == 2 and bridge.engine.buckets == (2,)


@pytest.mark.parametrize("value", [-1, 2.0, True, "2", 10_000])
def test_a_bad_tile_rows_fails_the_load(tiny_checkpoint: Path, value: Any) -> None:
    from model_repository.common.settings import ConfigError

    with pytest.raises(ConfigError, match="tile_rows"):
        bridges.token2wav(settings("token2wav", tiny_checkpoint, engine_options=json.dumps({"tile_rows": value})))
