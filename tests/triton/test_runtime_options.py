"""Every runtime option takes effect or is `invalid_runtime_config`; seeds; the client's voice clip (issue 17).

The real bridges on the tiny checkpoint, in-process (tests/triton/test_bridges.py's harness). The options are
the ones the gateway derives (gateway/session/runtime_config.py), so the two ends are checked against each other.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.protocol import validate
from gateway.protocol.config import ConfigContext, default_config
from gateway.protocol.errors import ProtocolError
from gateway.session.runtime_config import RuntimeDefaults, derive
from model_repository.common import bridges
from model_repository.common.bridges import options
from model_repository.common.codec import RequestError
from tests.triton.test_bridges import pcm, send, settings

UNITS = 4
CTX = ConfigContext(served_model="m", model_aliases=(), voices=("default",), default_voice_available=True,
                    idle_ttl_s=300.0, force_listen_count=0, default_input_rate_hz=16000,
                    default_output_format="wav")
_corrids = count(100)


@pytest.fixture(scope="module")
def stages(tiny_checkpoint: Path) -> Iterator[dict[str, Any]]:
    made = {stage: getattr(bridges, stage)(settings(stage, tiny_checkpoint)) for stage in ("stage0", "tts", "token2wav")}
    for bridge in made.values():
        bridge.start()
    yield made
    for bridge in made.values():
        bridge.stop()


def gateway_config(**changes: Any) -> dict[str, Any]:
    """What the gateway sends on open for a default session, with `changes` merged (nested one level)."""
    cfg = derive(default_config(CTX), RuntimeDefaults())
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def open_all(stages: dict[str, Any], config: dict[str, Any], keep: bool = False) -> tuple[int, dict[str, list[dict]]]:
    """Open one session on every stage (closed again unless `keep`); each stage's events."""
    corrid = next(_corrids)
    events = {name: [o.event for o in send(b, corrid=corrid, op="open", fence=(1, 1, 0), config=config).outs]
              for name, b in stages.items()}
    if not keep:
        close_all(stages, corrid)
    return corrid, events


def close_all(stages: dict[str, Any], corrid: int) -> None:
    for bridge in stages.values():
        send(bridge, corrid=corrid, op="close", fence=(1, 1, 0))  # an error for a session that never opened


def run_units(stage0: Any, config: dict[str, Any], units: int = UNITS) -> list[dict[str, Any]]:
    """A stage0 session over `units` units: per unit its decision, texts, tts_input rows and unit_done."""
    corrid = next(_corrids)
    assert send(stage0, corrid=corrid, op="open", fence=(1, 1, 0), config=config).kinds() == ["opened"]
    out = []
    for k in range(units):
        sink = send(stage0, corrid=corrid, op="append", fence=(1, 1, k + 1), pcm=pcm(k, seed=7))
        out.append({"decision": sink.of("decision")[0].event, "text": [o.event["text"] for o in sink.of("text")],
                    "rows": [o.tokens.tolist() for o in sink.of("tts_input")], "done": sink.of("unit_done")[0].event})
    send(stage0, corrid=corrid, op="close", fence=(1, 1, 0))
    return out


def codes(units: list[dict[str, Any]]) -> list[Any]:
    return [(u["decision"]["action"], u["text"], u["rows"]) for u in units]


def test_every_option_the_gateway_sends_is_accepted_by_every_stage(stages: dict[str, Any]) -> None:
    _, events = open_all(stages, gateway_config())
    assert {name: [e["type"] for e in evs] for name, evs in events.items()} == \
        {"stage0": ["opened"], "tts": ["opened"], "token2wav": ["opened"]}


@pytest.mark.parametrize("change,stage", [
    ({"thinker": {"min_speak_tokens_before_chunk_boundary": 8}}, "stage0"),  # no such rule in the reference loop
    ({"talker": {"top_k": 25}}, "tts"),  # the duplex TTS samples without top-k/top-p (Q14)
    ({"response_token_cap": 5}, "token2wav"),  # the gateway enforces max_output_tokens itself
    ({"initial_user_text": "hello"}, "stage0"),
    ({"talker": {"temperature": 0.0}}, "tts"),  # the TTS sampler divides by it
    ({"talker": {"repetition_penalty": "high"}}, "tts"),
    ({"talker": {"codes_per_unit": 10}}, "tts"),
    ({"thinker": {"max_tokens_per_unit": 21}}, "stage0"),  # beyond what the KV slot is sized for
    ({"voice": "nobody"}, "stage0"),
    ({"ref_audio": "not base64!"}, "stage0"),
    ({"seed": -3}, "stage0"),
])
def test_an_option_no_stage_applies_is_refused(stages: dict[str, Any], change: dict[str, Any], stage: str) -> None:
    _, events = open_all(stages, gateway_config(**change))
    assert [e.get("code") for e in events[stage]] == ["invalid_runtime_config"]


@pytest.mark.parametrize("t", [-0.01, 0.0, 1.0, 2.0, 2.01, float("nan"), float("inf")])
def test_the_stage_and_the_wire_accept_the_same_temperatures(t: float) -> None:
    """Two trust boundaries, one range: what the gateway refuses as `bad_event` the stage refuses too."""
    assert (options.MIN_TEMPERATURE, options.MAX_TEMPERATURE) == (validate.MIN_TEMPERATURE, validate.MAX_TEMPERATURE)
    verdicts = []
    for check, refused in ((lambda: validate.check_temperature(t, "response.temperature"), ProtocolError),
                           (lambda: options.unit_temperature({"temperature": t}), RequestError)):
        try:
            check()
            verdicts.append(True)
        except refused:
            verdicts.append(False)
    assert verdicts[0] == verdicts[1] == (0.0 <= t <= 2.0)


def test_thinker_options_take_effect(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    base = run_units(s0, gateway_config(seed=5, temperature=1.5))
    assert any(len(u["text"]) > 1 for u in base)  # this seed speaks several tokens in a unit
    assert all(u["done"]["metrics"]["thinker"]["tokens"] <= 2
               for u in run_units(s0, gateway_config(seed=5, temperature=1.5, thinker={"max_tokens_per_unit": 2})))
    capped = run_units(s0, gateway_config(seed=5, temperature=1.5, thinker={"max_speak_chars_per_unit": 1}))
    assert all(u["text"] == [] for u in capped)  # a 1-character cap rejects every text token
    forced = run_units(s0, gateway_config(seed=5, temperature=1.5, force_listen_count=2))
    assert [u["decision"]["forced"] for u in forced] == [True, True, False, False]
    assert [u["decision"]["action"] for u in forced[:2]] == ["listen", "listen"]
    text_only = run_units(s0, gateway_config(seed=5, temperature=1.5, text_only=True))
    assert codes(text_only) == [(a, t, []) for a, t, _ in codes(base)]  # same units, nothing for the talker
    assert any(u["rows"] for u in base)


def test_sessions_without_a_seed_differ_and_equal_seeds_match(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    unseeded = {k: v for k, v in gateway_config(temperature=1.5).items() if k != "seed"}
    assert codes(run_units(s0, unseeded)) != codes(run_units(s0, unseeded))
    assert codes(run_units(s0, gateway_config(seed=9, temperature=1.5))) == \
        codes(run_units(s0, gateway_config(seed=9, temperature=1.5)))


def test_a_new_seed_before_the_first_unit_reseeds_and_after_it_is_refused(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    corrid, _ = open_all(stages, gateway_config(seed=1, temperature=1.5), keep=True)
    for stage in stages.values():
        assert send(stage, corrid=corrid, op="update", fence=(1, 1, 0),
                    config=gateway_config(seed=9, temperature=1.5)).kinds() == ["updated"]
    sinks = [send(s0, corrid=corrid, op="append", fence=(1, 1, k + 1), pcm=pcm(k, seed=7)) for k in range(UNITS)]
    got = [(s.of("decision")[0].event["action"], [o.event["text"] for o in s.of("text")],
            [o.tokens.tolist() for o in s.of("tts_input")]) for s in sinks]
    assert got == codes(run_units(s0, gateway_config(seed=9, temperature=1.5)))
    late = send(s0, corrid=corrid, op="update", fence=(1, 1, 0), config=gateway_config(seed=2, temperature=1.5))
    assert [o.event.get("code") for o in late.outs] == ["invalid_runtime_config"]
    close_all(stages, corrid)


def test_the_clients_clip_replaces_the_voices_in_the_prefix(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    rng = np.random.default_rng(3)
    clip = (rng.standard_normal(32_000) * 3000).astype("<i2")  # 2 s at 16 kHz -> 20 prefix embeddings
    with_clip = gateway_config(seed=5, temperature=1.5, ref_audio=base64.b64encode(clip.tobytes()).decode())
    corrid = next(_corrids)
    send(s0, corrid=corrid, op="open", fence=(1, 1, 0), config=with_clip)
    send(s0, corrid=corrid, op="append", fence=(1, 1, 1), pcm=pcm(0, seed=7))
    voice_corrid = next(_corrids)
    send(s0, corrid=voice_corrid, op="open", fence=(1, 1, 0), config=gateway_config(seed=5, temperature=1.5))
    send(s0, corrid=voice_corrid, op="append", fence=(1, 1, 1), pcm=pcm(0, seed=7))
    clip_prefix = s0.engine.session(str(corrid)).prefix_len
    voice_prefix = s0.engine.session(str(voice_corrid)).prefix_len
    for c in (corrid, voice_corrid):
        send(s0, corrid=c, op="close", fence=(1, 1, 0))
    assert clip_prefix - voice_prefix == 20 - 10  # the default voice's clip is 1 s (model.md §9.4)
    assert codes(run_units(s0, with_clip)) != codes(run_units(s0, gateway_config(seed=5, temperature=1.5)))


def test_a_new_clip_before_the_first_unit_rebuilds_the_prefix_and_after_it_is_refused(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    clip = (np.random.default_rng(4).standard_normal(48_000) * 3000).astype("<i2")  # 3 s -> 30 embeddings
    corrid, _ = open_all(stages, gateway_config(seed=5), keep=True)
    with_clip = gateway_config(seed=5, ref_audio=base64.b64encode(clip.tobytes()).decode())
    for stage in stages.values():
        assert send(stage, corrid=corrid, op="update", fence=(1, 1, 0), config=with_clip).kinds() == ["updated"]
    send(s0, corrid=corrid, op="append", fence=(1, 1, 1), pcm=pcm(0, seed=7))
    with_voice = s0.engine.session(str(corrid)).prefix_len
    late = send(s0, corrid=corrid, op="update", fence=(1, 1, 0), config=gateway_config(seed=5))
    assert [o.event.get("code") for o in late.outs] == ["invalid_runtime_config"]
    close_all(stages, corrid)
    plain, _ = open_all(stages, gateway_config(seed=5), keep=True)
    send(s0, corrid=plain, op="append", fence=(1, 1, 1), pcm=pcm(0, seed=7))
    assert with_voice - s0.engine.session(str(plain)).prefix_len == 30 - 10
    close_all(stages, plain)


def test_a_partial_update_changes_only_what_it_names(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    corrid, _ = open_all(stages, gateway_config(seed=5, voice="default"), keep=True)
    send(s0, corrid=corrid, op="append", fence=(1, 1, 1), pcm=pcm(0, seed=7))
    for stage in stages.values():  # after the first unit: no seed, voice or clip in it, so nothing is re-opened
        assert send(stage, corrid=corrid, op="update", fence=(1, 1, 0), config={"temperature": 0.3}).kinds() \
            == ["updated"]
    assert s0.engine.session(str(corrid)).pending_params.temperature == 0.3
    close_all(stages, corrid)


def test_talker_options_take_effect(stages: dict[str, Any]) -> None:
    """The same rows through the TTS stage: the talker temperature changes the codes, per session."""
    tts = stages["tts"]
    rng = np.random.default_rng(2)
    rows, hidden = np.arange(6, dtype=np.int64) + 40, (rng.standard_normal(6 * tts.llm_dim) * 0.5).astype(np.float32)

    def unit_codes(talker: dict[str, Any]) -> list[int]:
        corrid = next(_corrids)
        send(tts, corrid=corrid, op="open", fence=(1, 1, 0), config=gateway_config(seed=3, talker=talker))
        sink = send(tts, corrid=corrid, op="append", fence=(1, 1, 1), tokens=rows, hidden=hidden,
                    config={"unit": 0, "is_turn_eos": [False] * 6, "turn_start": False})
        send(tts, corrid=corrid, op="close", fence=(1, 1, 0))
        return sink.of("audio_tokens")[0].tokens.tolist()

    base = unit_codes({})
    assert len(base) == 25 and unit_codes({}) == base  # same seed, same settings: the same codes
    assert unit_codes({"temperature": 0.1}) != base
    assert unit_codes({"repetition_penalty": 4.0}) != base
