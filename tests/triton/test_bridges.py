"""The real-engine bridges in-process (no server): event mapping, typed errors, one close per request.

Each bridge loads the seeded tiny checkpoint and runs its own engine thread, exactly as inside a
Triton stub; a recording sink stands in for the adapter's ResponseSink.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.audio.frontend import AudioFrontEnd
from engine.loader import load_checkpoint
from engine.stage0 import Fence, SamplingParams, Stage0Config, Stage0Engine, TokenEvent, UnitDone
from engine.stage0.frontend import AudioFrontEndAdapter
from model_repository.common import bridges
from model_repository.common.codec import StageOutput, StageRequest
from model_repository.common.settings import StageSettings

WAIT_S = 60.0
FIRST, UNIT = 16_480, 16_000


class Sink:
    def __init__(self) -> None:
        self.outs: list[StageOutput] = []
        self.closes = 0
        self.done = threading.Event()

    def emit(self, out: StageOutput) -> None:
        assert not self.closes, "emit after close"
        self.outs.append(out)

    def close(self) -> None:
        self.closes += 1
        self.done.set()

    def kinds(self) -> list[str]:
        return [o.event["type"] for o in self.outs]

    def of(self, kind: str) -> list[StageOutput]:
        return [o for o in self.outs if o.event["type"] == kind]


def settings(stage: str, ckpt: Path, **kw: Any) -> StageSettings:
    return StageSettings(stage=stage, engine_factory=f"model_repository.common.bridges:{stage}",
                         checkpoint_dir=str(ckpt), device="cpu", dtype="float32", max_sessions=2, kv_window=4096,
                         session_idle_ttl_s=60, **kw)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path) -> Iterator[dict[str, Any]]:
    made = {stage: getattr(bridges, stage)(settings(stage, tiny_checkpoint)) for stage in ("stage0", "tts", "token2wav")}
    for bridge in made.values():
        bridge.start()
    yield made
    for bridge in made.values():
        bridge.stop()


def send(bridge: Any, wait: bool = True, **kw: Any) -> Sink:
    sink = Sink()
    bridge.submit(StageRequest(**kw), sink)
    if wait:
        assert sink.done.wait(WAIT_S)
    return sink


def pcm(index: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + index)
    return (rng.standard_normal(FIRST if index == 0 else UNIT) * 0.1).astype(np.float32)


def reference_stage0(ckpt: Path, seed: int, units: list[np.ndarray]) -> list[Any]:
    """The same units through a Stage0Engine driven directly (no bridge, no thread): its events. The prefix
    carries the default voice's clip, as the bridge's does for a session without `ref_audio`."""
    ck = load_checkpoint(ckpt, device="cpu", dtype=torch.float32, with_vision=False, with_token2wav=False)
    front = AudioFrontEndAdapter(AudioFrontEnd(ck.model.apm, ck.model.audio_projection_layer, ck.config.audio))
    events: list[Any] = []
    engine = Stage0Engine(ck.model.llm, ck.tokenizer, front, events.append,
                          Stage0Config(max_sessions=2, window_high=4096, window_low=3072))
    engine.open("ref", Fence(1, 1), params=SamplingParams(seed=seed), force_listen_count=0,
                ref_audio=ck.voice("default").ref_audio_16k)
    for i, unit in enumerate(units):
        engine.append("ref", Fence(1, 1, i + 1), torch.from_numpy(unit))
        engine.run_until_idle()
    return events


def test_stage0_events_are_the_engines(engines: dict[str, Any], tiny_checkpoint: Path) -> None:
    s0, seed, units = engines["stage0"], 3, [pcm(0), pcm(1)]
    assert send(s0, corrid=11, op="open", fence=(1, 1, 0), config={"seed": seed, "force_listen_count": 0}).kinds() \
        == ["opened"]
    sinks = [send(s0, corrid=11, op="append", fence=(1, 1, i + 1), pcm=u) for i, u in enumerate(units)]
    send(s0, corrid=11, op="close", fence=(1, 1, 0))
    ref = reference_stage0(tiny_checkpoint, seed, units)
    in_turn = False  # a speak unit opens a turn; `end_of_turn` closes it
    for index, sink in enumerate(sinks):
        assert sink.closes == 1
        kinds = sink.kinds()
        assert kinds[0] == "decision" and kinds[-1] == "unit_done"
        mine = [e for e in ref if e.unit_index == index]
        done = mine[-1]
        assert isinstance(done, UnitDone)
        decision = next(e for e in mine if isinstance(e, TokenEvent) and e.decision)
        assert sink.outs[0].event["action"] == ("listen" if decision.listen else "speak")
        assert sink.outs[0].event["forced"] == decision.forced == done.forced
        texts = [(e.token_id, e.text) for e in mine if isinstance(e, TokenEvent) and not e.decision and e.text]
        assert [(o.event["token_id"], o.event["text"]) for o in sink.of("text")] == texts
        assert sink.outs[-1].event["is_listen"] == done.is_listen
        assert sink.outs[-1].event["metrics"]["thinker"]["tokens"] == done.metrics.tokens
        if not done.is_listen:  # every speak unit, one without rows too (model.md §3.7 Q11)
            tts_in = sink.of("tts_input")[0]
            assert tts_in.tokens.tolist() == [r.token_id for r in done.rows]
            expect = np.array([r.hidden.numpy() for r in done.rows], dtype=np.float32).reshape(-1)  # [n * H]
            np.testing.assert_allclose(tts_in.hidden, expect, rtol=1e-5, atol=1e-5)
            assert tts_in.event["is_turn_eos"] == [r.is_turn_eos for r in done.rows]
            assert tts_in.event["turn_start"] is not in_turn
            in_turn = not done.end_of_turn
        else:
            assert not sink.of("tts_input")
            in_turn = in_turn and not done.end_of_turn
    assert any(s.of("tts_input") for s in sinks)  # this seed speaks: the payload path was exercised


@pytest.mark.parametrize("config,code", [({"temperature": "hot"}, "invalid_runtime_config"),
                                         ({"top_p": 7}, "invalid_runtime_config"),
                                         ({"instructions": 5}, "invalid_runtime_config")])
def test_bad_config_is_typed(engines: dict[str, Any], config: dict[str, Any], code: str) -> None:
    sink = send(engines["stage0"], corrid=12, op="open", fence=(1, 1, 0), config=config)
    assert [o.event["code"] for o in sink.outs] == [code] and sink.closes == 1


def test_engine_errors_map_to_documented_codes(engines: dict[str, Any]) -> None:
    s0, tts, t2w = engines["stage0"], engines["tts"], engines["token2wav"]
    send(s0, corrid=13, op="open", fence=(1, 1, 0), config={"seed": 1})
    cases = [
        (send(s0, corrid=13, op="append", fence=(1, 1, 1), pcm=np.zeros(7, np.float32)), "bad_audio"),
        (send(s0, corrid=99, op="append", fence=(1, 1, 1), pcm=pcm(0)), "session_not_found"),
        (send(s0, corrid=13, op="open", fence=(1, 1, 0)), "invalid_request"),
        (send(tts, corrid=99, op="open", fence=(1, 1, 0)) and
         send(tts, corrid=99, op="append", fence=(1, 1, 1), tokens=np.arange(2), hidden=np.zeros(5, np.float32)),
         "invalid_request"),
        (send(t2w, corrid=99, op="open", fence=(1, 1, 0), config={"voice": "nobody"}), "invalid_runtime_config"),
    ]
    for sink, code in cases:
        assert [o.event.get("code") for o in sink.outs] == [code], sink.outs
        assert sink.closes == 1
    send(s0, corrid=13, op="close", fence=(1, 1, 0))
    send(tts, corrid=99, op="close", fence=(1, 1, 0))


def test_cancel_ends_every_queued_unit_once(engines: dict[str, Any]) -> None:
    """Units queued behind a cancel never reach UnitDone in the engine; their requests still end."""
    s0 = engines["stage0"]
    send(s0, corrid=14, op="open", fence=(1, 1, 0), config={"seed": 2, "force_listen_count": 0})
    sinks = [send(s0, wait=False, corrid=14, op="append", fence=(1, 1, i + 1), pcm=pcm(i)) for i in range(3)]
    cancel = send(s0, corrid=14, op="cancel", fence=(1, 1, 3), next_fence=(1, 2, 3))
    assert cancel.kinds() == ["cancelled"]
    for sink in sinks:
        assert sink.done.wait(WAIT_S) and sink.closes == 1
        assert sink.kinds()[-1] == "unit_done"
    after = send(s0, corrid=14, op="append", fence=(1, 2, 4), pcm=pcm(3))
    assert after.kinds()[0] == "decision" and after.kinds()[-1] == "unit_done"
    send(s0, corrid=14, op="close", fence=(1, 2, 0))


def test_tts_and_token2wav_render_a_unit(engines: dict[str, Any]) -> None:
    tts, t2w = engines["tts"], engines["token2wav"]
    llm_dim = tts.llm_dim
    send(tts, corrid=15, op="open", fence=(1, 1, 0), config={"seed": 4})
    send(t2w, corrid=15, op="open", fence=(1, 1, 0), config={"seed": 4})
    rng = np.random.default_rng(0)
    codes = send(tts, corrid=15, op="append", fence=(1, 1, 1), tokens=np.arange(4),
                 hidden=rng.standard_normal(4 * llm_dim).astype(np.float32),
                 config={"unit": 0, "is_turn_eos": [False] * 4, "turn_start": True})
    assert codes.kinds() == ["audio_tokens"] and codes.outs[0].tokens.size == codes.outs[0].event["count"]
    audio = send(t2w, corrid=15, op="append", fence=(1, 1, 1), tokens=codes.outs[0].tokens, config={"unit": 0})
    assert audio.kinds() and set(audio.kinds()) == {"audio"} and audio.closes == 1
    assert [o.event["seq"] for o in audio.outs] == list(range(len(audio.outs)))
    assert [o.event["last"] for o in audio.outs] == [False] * (len(audio.outs) - 1) + [True]
    assert all(o.audio.dtype == np.int16 and o.audio.size == o.event["samples"] for o in audio.outs)
    for bridge in (tts, t2w):
        assert send(bridge, corrid=15, op="close", fence=(1, 1, 0)).kinds() == ["closed"]


def test_sampling_params_follow_the_gateway_config() -> None:
    from model_repository.common.bridges.options import sampling_params

    got = sampling_params({"temperature": 0.5, "top_k": 9, "seed": 7, "thinker": {"top_p": 0.6, "top_k": 11}})
    assert got == SamplingParams(temperature=0.5, top_k=11, top_p=0.6, seed=7)


def test_unknown_engine_option_fails_the_load(tiny_checkpoint: Path) -> None:
    from model_repository.common.settings import ConfigError

    with pytest.raises(ConfigError, match="compile_stepp"):
        bridges.tts(settings("tts", tiny_checkpoint, engine_options='{"compile_stepp": true}'))


@pytest.mark.parametrize("name,bad,default,value,effect", [
    # the TTS KV slot per session: one KV row per position (+1)
    ("max_turn_positions", ('"4096"', "0", "true"), 8192, 1024, lambda e: (e.runner.kv.max_len - 1,)),
    # every GEMM on exactly that many rows (0 = off): the backbone and code head, and the projector
    ("gemm_tile_rows", ('"8"', "-1", "true"), 0, 16,
     lambda e: (e.model.min_rows, e.model.projector_semantic.tile_rows)),
])
def test_tts_config_options(tiny_checkpoint: Path, name: str, bad: tuple[str, ...], default: int, value: int,
                            effect: Callable[[Any], tuple[int, ...]]) -> None:
    """The option reaches the engine config and the model (the config's default when absent); a value of the
    wrong type or range fails the load."""
    from model_repository.common.settings import ConfigError

    for raw in bad:
        with pytest.raises(ConfigError, match=name):
            bridges.tts(settings("tts", tiny_checkpoint, engine_options=f'{{"{name}": {raw}}}'))
    for options, want in (("{}", default), (json.dumps({name: value}), value)):
        engine = bridges.tts(settings("tts", tiny_checkpoint, engine_options=options)).engine
        assert getattr(engine.cfg, name) == want and set(effect(engine)) == {want}


def test_stage0_audio_worker_option(tiny_checkpoint: Path) -> None:
    """Off by default (the front end runs in the step); `true` makes the bridge's start run it on its own
    thread; anything but a bool fails the load."""
    from model_repository.common.settings import ConfigError

    with pytest.raises(ConfigError, match="audio_worker"):
        bridges.stage0(settings("stage0", tiny_checkpoint, engine_options='{"audio_worker": "yes"}'))
    for options, running in (("{}", False), ('{"audio_worker": true}', True), ('{"audio_worker": false}', False)):
        bridge = bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=options))
        bridge.start()
        try:
            assert (bridge.engine.audio_worker is not None) is running
            assert bridge.engine.audio_worker is None or bridge.engine.audio_worker.running
        finally:
            bridge.stop()
        assert bridge.engine.audio_worker is None


def test_stage0_mixed_step_option(tiny_checkpoint: Path) -> None:
    """split by default; the profile's value reaches the runner; an unknown value fails the load."""
    with pytest.raises(ValueError, match="mixed_step"):
        bridges.stage0(settings("stage0", tiny_checkpoint, engine_options='{"mixed_step": "both"}'))
    for options, mode in (("{}", "split"), ('{"mixed_step": "merge"}', "merge"), ('{"mixed_step": "shared"}', "shared")):
        bridge = bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=options))
        assert bridge.engine.runner.mixed_step == mode


def test_stage0_bucket_options(tiny_checkpoint: Path) -> None:
    """prefill_batch_buckets and shared_decode_buckets reach the engine's config; anything but a list of positive
    integers fails the load."""
    from model_repository.common.settings import ConfigError

    for bad in ('{"shared_decode_buckets": 16}', '{"prefill_batch_buckets": [2, 0]}', '{"prefill_batch_buckets": []}'):
        with pytest.raises(ConfigError, match="buckets"):
            bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=bad))
    bridge = bridges.stage0(settings("stage0", tiny_checkpoint,
                                     engine_options='{"prefill_batch_buckets": [2, 16], "shared_decode_buckets": [2, 32]}'))
    assert bridge.engine.config.prefill_batch_buckets == (2, 16)
    assert bridge.engine.config.shared_decode_buckets == (2, 32)
    assert bridges.stage0(settings("stage0", tiny_checkpoint)).engine.config.prefill_batch_buckets == (2, 4, 8)


def test_stage0_gemm_min_rows_option(tiny_checkpoint: Path) -> None:
    """gemm_min_rows reaches the model (32 by default); anything but an integer >= 0 fails the load."""
    from model_repository.common.settings import ConfigError

    for bad in ('{"gemm_min_rows": -1}', '{"gemm_min_rows": "32"}', '{"gemm_min_rows": true}'):
        with pytest.raises(ConfigError, match="gemm_min_rows"):
            bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=bad))
    assert bridges.stage0(settings("stage0", tiny_checkpoint)).engine.model.min_rows == 32
    bridge = bridges.stage0(settings("stage0", tiny_checkpoint, engine_options='{"gemm_min_rows": 0}'))
    assert bridge.engine.config.gemm_min_rows == 0
    assert {layer.mlp.min_rows for layer in bridge.engine.model.model.layers} == {0}


@pytest.mark.parametrize("name,bad,default,value", [
    ("prefix_chunk", ("-1", "8.5", "false"), 512, 64),  # system-prefix positions per step (0 = whole)
    ("prefill_hold_ms", ("-1", "2.5", "true"), 0, 20),  # a unit waits for token rows (0 = off)
    ("gemm_pad_buckets", ("1", '"false"', "null"), True, False),  # graphs pad their GEMMs over their buckets
    ("flex_keys_per_split", ("-1", "512.0", "true"), 512, 0),  # the flex decoding kernel's split (0 = torch's)
    ("flex_prefill_keys_per_split", ("-1", "512.0", "true"), 512, 2048),  # the same for unit prefills
    ("flex_prefill_warps", ("-1", "4.0", "true"), 0, 4),  # that kernel's Triton warps for unit prefills (0 = torch's)
    ("flex_prefill_stages", ("-1", "2.0", "false"), 0, 2),  # and its stages
    ("gemm_tile_rows", ("-1", "128.0", "true"), 0, 128),  # every LLM GEMM in tiles of this many rows (0 = off)
])
def test_stage0_config_options(tiny_checkpoint: Path, name: str, bad: tuple[str, ...], default: object,
                               value: object) -> None:
    """The option reaches the engine config (the config's default when absent); a value of the wrong type or
    range fails the load."""
    from model_repository.common.settings import ConfigError

    for raw in bad:
        with pytest.raises(ConfigError, match=name):
            bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=f'{{"{name}": {raw}}}'))
    assert getattr(bridges.stage0(settings("stage0", tiny_checkpoint)).engine.config, name) == default
    options = json.dumps({name: value})
    assert getattr(bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=options)).engine.config,
                   name) == value


def test_stage0_flex_split_lengths_reach_the_model(tiny_checkpoint: Path) -> None:
    """The model's attention reads the splits from the model (tests/engine/test_flex_prefill.py), which the engine
    sets from its config, each from its own option."""
    options = ('{"flex_keys_per_split": 0, "flex_prefill_keys_per_split": 2048, "flex_prefill_warps": 4, '
               '"flex_prefill_stages": 3}')
    model = bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=options)).engine.model
    assert (model.flex_keys_per_split, model.flex_prefill_keys_per_split) == (0, 2048)
    assert (model.flex_prefill_warps, model.flex_prefill_stages) == (4, 3)


def test_stage0_session_warm_up_leaves_no_trace(tiny_checkpoint: Path) -> None:
    """The warm-up's sessions (k at once, two units each, for k up to max_sessions) close again: every slot is
    free, and a session served afterwards decides and says exactly what an engine that never warmed up does."""
    bridge = bridges.stage0(settings("stage0", tiny_checkpoint))
    lines: list[str] = []
    bridge.warm_up(lines.append)  # on CPU: the front end only; its states give their pool slots back
    audio = bridge.engine.frontend.audio
    assert audio.kv_pool.free == audio.streamer.pool.free == bridge.settings.max_sessions
    lines.clear()
    bridge.warm_sessions(lines.append)  # what a GPU's warm-up runs next
    assert lines == ["sessions: 1 at once, 2 units each", "sessions: 2 at once, 2 units each"]
    assert not bridge.engine.table.sessions and bridge.engine.table.slots.free == bridge.settings.max_sessions
    seed, units = 5, [pcm(0, 1), pcm(1, 1)]
    bridge.start()
    try:
        send(bridge, corrid=21, op="open", fence=(1, 1, 0), config={"seed": seed, "force_listen_count": 0})
        sinks = [send(bridge, corrid=21, op="append", fence=(1, 1, i + 1), pcm=u) for i, u in enumerate(units)]
    finally:
        bridge.stop()
    ref = reference_stage0(tiny_checkpoint, seed, units)
    for index, sink in enumerate(sinks):
        mine = [e for e in ref if e.unit_index == index and isinstance(e, TokenEvent)]
        decision = next(e for e in mine if e.decision)
        assert sink.outs[0].event["action"] == ("listen" if decision.listen else "speak")
        assert [o.event["token_id"] for o in sink.of("text")] == [e.token_id for e in mine if not e.decision and e.text]
    assert any(s.of("text") for s in sinks)  # this seed speaks: the comparison saw tokens


def test_stage0_decode_attention_option(tiny_checkpoint: Path) -> None:
    """`engine_options.stage0.decode_attention`: matmul by default, flex on request (the decode graphs then keep one
    span bucket); an unknown value fails the load naming the option."""
    with pytest.raises(ValueError, match="decode_attention"):
        bridges.stage0(settings("stage0", tiny_checkpoint, engine_options='{"decode_attention": "fast"}'))
    for options, attention in (("{}", "matmul"), ('{"decode_attention": "flex"}', "flex")):
        bridge = bridges.stage0(settings("stage0", tiny_checkpoint, engine_options=options))
        assert bridge.engine.runner.decode_attention == attention
