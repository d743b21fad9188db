"""The client's clip is the Token2Wav voice prompt (issue 17, model.md §6.1): the real Token2Wav bridge on the
tiny checkpoint, in-process (tests/triton/test_bridges.py's harness), with and without the two ONNX models."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clients.triton_example import FIRST_UNIT_SAMPLES, UNIT_SAMPLES, TritonSession
from model_repository.common import bridges
from serve.launcher import TritonServer
from tests.triton.talk import run_session, session_config
from tests.triton.test_bridges import send, settings

CODES = np.random.default_rng(11).integers(0, 6561, 25)  # one unit's codes
# The tiny random HiFT's magnitudes are exp(~0): its speech stays within 1 LSB of PCM16 silence, where no voice
# shows. A bias on the magnitude half of conv_post makes it audible (exp(5), clipped at 100 as in §1.7).
AUDIBLE_BIAS = 5.0
_corrids = count(500)


def encoded(seconds: float, seed: int, scale: float = 3000.0) -> str:
    pcm = (np.random.default_rng(seed).standard_normal(int(seconds * 16_000)) * scale).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


@pytest.fixture(scope="module")
def t2w(tiny_checkpoint: Path) -> Iterator[Any]:
    bridge = audible(bridges.token2wav(settings("token2wav", tiny_checkpoint)))
    bridge.start()
    yield bridge
    bridge.stop()


def audible(bridge: Any) -> Any:
    post = bridge.engine.models.hift.conv_post
    half = post.bias.shape[0] // 2  # [magnitude logits | phase]
    with torch.no_grad():
        post.bias[:half] += AUDIBLE_BIAS
    return bridge


def speak(bridge: Any, config: dict[str, Any], keep: bool = False) -> tuple[int, np.ndarray]:
    """Open a session with `config`, render one end-of-turn unit of CODES; its PCM (closed unless `keep`)."""
    corrid = next(_corrids)
    opened = send(bridge, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 3, **config})
    assert opened.kinds() == ["opened"], [o.event for o in opened.outs]
    sink = send(bridge, corrid=corrid, op="append", fence=(1, 1, 1), tokens=CODES,
                config={"unit": 0, "end_of_turn": True})
    assert sink.kinds() and set(sink.kinds()) == {"audio"}
    pcm = np.concatenate([o.audio for o in sink.outs])
    assert np.count_nonzero(pcm) > pcm.size // 2  # audible: equal or not, the voices show
    if not keep:
        send(bridge, corrid=corrid, op="close", fence=(1, 1, 0))
    return corrid, pcm


def clip_voices(bridge: Any) -> list[str]:
    return [v for v in bridge.engine.voices if v.startswith("clip:")]


def test_the_clip_is_the_voice_prompt_and_sessions_with_one_clip_share_it(t2w: Any) -> None:
    named = speak(t2w, {})[1]
    a, pcm_a = speak(t2w, {"ref_audio": encoded(2.0, seed=1)}, keep=True)
    b, pcm_b = speak(t2w, {"ref_audio": encoded(2.0, seed=2)})
    c, pcm_a2 = speak(t2w, {"ref_audio": encoded(2.0, seed=1)}, keep=True)
    assert not np.array_equal(pcm_a, pcm_b) and not np.array_equal(pcm_a, named)
    assert np.array_equal(pcm_a, pcm_a2)
    assert len(clip_voices(t2w)) == 1  # a and c share one base cache; b's went with b
    for corrid in (a, c):
        send(t2w, corrid=corrid, op="close", fence=(1, 1, 0))
    assert clip_voices(t2w) == []


def test_a_new_clip_before_the_first_unit_changes_the_voice(t2w: Any) -> None:
    corrid = next(_corrids)
    send(t2w, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 3})
    update = send(t2w, corrid=corrid, op="update", fence=(1, 1, 0),
                  config={"seed": 3, "ref_audio": encoded(2.0, seed=1)})
    assert update.kinds() == ["updated"]
    sink = send(t2w, corrid=corrid, op="append", fence=(1, 1, 1), tokens=CODES, config={"unit": 0, "end_of_turn": True})
    same = send(t2w, corrid=corrid, op="update", fence=(1, 1, 0), config={"seed": 3})  # names no voice: unchanged
    late = send(t2w, corrid=corrid, op="update", fence=(1, 1, 0), config={"seed": 3, "voice": "default"})
    assert same.kinds() == ["updated"]
    assert [o.event.get("code") for o in late.outs] == ["invalid_runtime_config"]
    send(t2w, corrid=corrid, op="close", fence=(1, 1, 0))
    assert np.array_equal(np.concatenate([o.audio for o in sink.outs]),
                          speak(t2w, {"ref_audio": encoded(2.0, seed=1)})[1])
    assert clip_voices(t2w) == []


def test_requests_sent_behind_a_clip_being_made_keep_their_order(t2w: Any) -> None:
    corrid = next(_corrids)
    sinks = [send(t2w, wait=False, corrid=corrid, op="open", fence=(1, 1, 0),
                  config={"seed": 3, "ref_audio": encoded(3.0, seed=9)}),
             send(t2w, wait=False, corrid=corrid, op="append", fence=(1, 1, 1), tokens=CODES,
                  config={"unit": 0, "end_of_turn": True})]  # sent while the clip is still being made
    for sink in sinks:
        assert sink.done.wait(60)
    assert [s.kinds()[0] for s in sinks] == ["opened", "audio"]
    send(t2w, corrid=corrid, op="close", fence=(1, 1, 0))
    assert clip_voices(t2w) == []


@pytest.mark.parametrize("clip,why", [(encoded(0.1, seed=1), "at least"), (encoded(2.0, seed=1, scale=0.0), "silent")])
def test_a_clip_that_makes_no_voice_is_bad_audio(t2w: Any, clip: str, why: str) -> None:
    corrid = next(_corrids)
    opened = send(t2w, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 3, "ref_audio": clip})
    assert [(o.event["type"], o.event.get("code")) for o in opened.outs] == [("error", "bad_audio")]
    assert why in opened.outs[0].event["message"]
    assert speak(t2w, {})[1].size  # the stage serves on


def test_without_the_onnx_models_a_clip_keeps_the_named_voice(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             t2w: Any) -> None:
    from make_tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", 0, vision=False, prompt_models=False)
    with caplog.at_level(logging.WARNING):
        plain = audible(bridges.token2wav(settings("token2wav", ckpt)))
    assert [r.getMessage() for r in caplog.records if "ref_audio does not change the vocoder voice" in r.getMessage()]
    plain.start()
    try:
        with_clip = speak(plain, {"ref_audio": encoded(2.0, seed=1)})[1]
        assert np.array_equal(with_clip, speak(plain, {})[1])
        assert clip_voices(plain) == []
    finally:
        plain.stop()
    assert np.array_equal(with_clip, speak(t2w, {})[1])  # same weights: the named voice of the full checkpoint


@pytest.mark.e2e
def test_a_clip_reaches_the_vocoder_through_tritonserver(torch_server: TritonServer) -> None:
    """The CONFIG clip travels through `duplex` to the Token2Wav stub: a good one serves a session, a clip
    too short for a voice prompt fails the open with `bad_audio`."""
    noise = (np.random.default_rng(5).standard_normal(FIRST_UNIT_SAMPLES + 2 * UNIT_SAMPLES) * 0.1).astype(np.float32)
    good = run_session(torch_server.grpc_url, noise, 0, ref_audio=encoded(2.0, seed=1))
    replies = [good.opened, *good.units, good.closed]
    assert not [e for r in replies for e in r.of_type("error")], [r.events for r in replies]
    assert len(good.units) == 3 and all(r.of_type("unit_done") for r in good.units)
    session = TritonSession(torch_server.grpc_url)
    try:
        bad = session.request("open", (1, 1, 0), config=session_config(0, ref_audio=encoded(0.1, seed=1)))
    finally:
        session.close()
    assert [e.get("code") for e in bad.of_type("error") if "voice prompt" in e.get("message", "")] == ["bad_audio"], \
        bad.events
