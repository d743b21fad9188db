"""An append's CONFIG `{"thinker": {"temperature": t}}` through the codec and the real stage0 bridge.

The reference is a Stage0Engine driven directly with the session-level path (`update(params)` before the unit
and back after it): the bridge's unit with the override must produce exactly that unit, and the session's own
temperature must hold for the units after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.audio.frontend import AudioFrontEnd
from engine.loader import load_checkpoint
from engine.stage0 import Fence, SamplingParams, Stage0Config, Stage0Engine, TokenEvent, UnitDone
from engine.stage0.frontend import AudioFrontEndAdapter
from model_repository.common import bridges
from model_repository.common.bridges.options import sampling_params, unit_temperature
from model_repository.common.codec import RequestError, parse_request, request_arrays
from tests.triton.test_bridges import pcm, send, settings

SEED = 3
UNITS = 3
HOT_UNIT = 1
GREEDY = 0.0  # the override under test: temperature 0 = greedy, far from the session's 0.7 sampling
BAD = [{"thinker": {"temperature": "hot"}}, {"thinker": {"temperature": 2.5}}, {"temperature": -1},
       {"thinker": {"temperature": True}}, {"thinker": {"top_p": 0.5}}, {"voice": "x"}, {"thinker": 3}]


@pytest.fixture(scope="module")
def stage0(tiny_checkpoint: Path) -> Iterator[Any]:
    bridge = bridges.stage0(settings("stage0", tiny_checkpoint))
    bridge.start()
    yield bridge
    bridge.stop()


def override(k: int) -> dict[str, Any] | None:
    return {"thinker": {"temperature": GREEDY}} if k == HOT_UNIT else None


def bridge_units(stage0: Any, corrid: int, config_of: Any) -> list[list[tuple]]:
    """One session through the bridge; per unit: its decision and (token_id, text) pieces."""
    assert send(stage0, corrid=corrid, op="open", fence=(1, 1, 0),
                config={"seed": SEED, "force_listen_count": 0}).kinds() == ["opened"]
    out = []
    for k in range(UNITS):
        sink = send(stage0, corrid=corrid, op="append", fence=(1, 1, k + 1), pcm=pcm(k), config=config_of(k))
        assert sink.kinds()[-1] == "unit_done" and sink.closes == 1
        out.append([("decision", o.event["action"]) if o.event["type"] == "decision" else
                    (o.event["token_id"], o.event["text"])
                    for o in sink.outs if o.event["type"] in ("decision", "text")])
    send(stage0, corrid=corrid, op="close", fence=(1, 1, 0))
    return out


def reference_units(ckpt: Path, terminators: frozenset[int], hot: SamplingParams | None) -> list[list[tuple]]:
    """The same units on a Stage0Engine; `hot` is set at session level (update) for HOT_UNIT only."""
    ck = load_checkpoint(ckpt, device="cpu", dtype=torch.float32, with_vision=False, with_token2wav=False)
    front = AudioFrontEndAdapter(AudioFrontEnd(ck.model.apm, ck.model.audio_projection_layer, ck.config.audio))
    events: list[Any] = []
    engine = Stage0Engine(ck.model.llm, ck.tokenizer, front, events.append,
                          Stage0Config(max_sessions=2, window_high=4096, window_low=3072))
    base = SamplingParams(seed=SEED)
    engine.open("ref", Fence(1, 1), params=base, force_listen_count=0,
                ref_audio=ck.voice("default").ref_audio_16k)  # the bridge's prefix: the default voice's clip
    for k in range(UNITS):
        if hot is not None and k in (HOT_UNIT, HOT_UNIT + 1):
            engine.update("ref", Fence(1, 1), params=hot if k == HOT_UNIT else base)
        engine.append("ref", Fence(1, 1, k + 1), torch.from_numpy(pcm(k)))
        engine.run_until_idle()
    out: list[list[tuple]] = [[] for _ in range(UNITS)]
    for e in events:
        if isinstance(e, TokenEvent) and e.decision:
            out[e.unit_index].append(("decision", "listen" if e.listen else "speak"))
        elif isinstance(e, TokenEvent) and e.text:
            out[e.unit_index].append((e.token_id, e.text))
    assert sum(isinstance(e, UnitDone) for e in events) == UNITS
    return out


def test_append_config_round_trips_through_the_codec() -> None:
    cfg = {"thinker": {"temperature": 0.3}}
    arrays = request_arrays("append", (1, 2, 3), pcm=pcm(0), config=cfg)
    req = parse_request(arrays.get, corrid=5, start=False, end=False)
    assert req.op == "append" and req.config == cfg and unit_temperature(req.config) == 0.3


def test_unit_override_samples_like_the_session_level_temperature(stage0: Any, tiny_checkpoint: Path) -> None:
    got = bridge_units(stage0, 31, override)
    plain = bridge_units(stage0, 32, lambda k: None)
    want = reference_units(tiny_checkpoint, stage0.terminators,
                           dataclasses.replace(SamplingParams(seed=SEED), greedy=True))
    assert got == want
    assert plain == reference_units(tiny_checkpoint, stage0.terminators, None)
    assert got[HOT_UNIT] != plain[HOT_UNIT]  # the override changed that unit (the test can tell)
    assert got[0] == plain[0]


@pytest.mark.parametrize("config", BAD)
def test_bad_override_is_invalid_runtime_config_and_the_session_goes_on(stage0: Any,
                                                                         config: dict[str, Any]) -> None:
    send(stage0, corrid=33, op="open", fence=(1, 1, 0), config={"seed": SEED, "force_listen_count": 0})
    bad = send(stage0, corrid=33, op="append", fence=(1, 1, 1), pcm=pcm(0), config=config)
    assert [o.event.get("code") for o in bad.outs] == ["invalid_runtime_config"] and bad.closes == 1
    good = send(stage0, corrid=33, op="append", fence=(1, 1, 1), pcm=pcm(0), config={"thinker": {"temperature": 1}})
    assert good.kinds()[0] == "decision" and good.kinds()[-1] == "unit_done"
    send(stage0, corrid=33, op="close", fence=(1, 1, 0))


def test_temperature_zero_is_greedy_on_the_session_path_too() -> None:
    assert sampling_params({"temperature": 0, "seed": 4}) == SamplingParams(greedy=True, seed=4)
    assert sampling_params({"temperature": 0.7, "thinker": {"temperature": 0}}).greedy
    assert unit_temperature({}) is None and unit_temperature({"thinker": {"temperature": None}}) is None
    with pytest.raises(RequestError, match="invalid_runtime_config"):
        sampling_params({"thinker": {"temperature": 2.01}})
