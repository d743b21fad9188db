"""The client's `ref_audio` reaches the runtime as 16 kHz mono PCM16; the runtime config carries the seed and
only options a stage applies (issue 17; protocol.md §2.5)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gateway.protocol.config import ConfigContext, apply_patch, default_config
from gateway.protocol.errors import ProtocolError
from gateway.protocol.validate import check_ref_audio
from gateway.session.runtime_config import RuntimeDefaults, derive
from tests.gateway.harness import tone_clip

CTX = ConfigContext(served_model="m", model_aliases=(), voices=("default",), default_voice_available=True,
                    idle_ttl_s=300.0, force_listen_count=3, default_input_rate_hz=24000,
                    default_output_format="pcm16")


@pytest.mark.parametrize("rate,channels,fmt,mime", [(24000, 2, "WAV", "wav"), (16000, 1, "FLAC", "flac"),
                                                    (44100, 1, "OGG", "ogg")])
def test_clip_is_decoded_once_to_16k_mono_pcm16(rate: int, channels: int, fmt: str, mime: str) -> None:
    ref = check_ref_audio(tone_clip(1.5, hz=440.0, amplitude=0.5, rate=rate, channels=channels, fmt=fmt, mime=mime))
    assert ref is not None and ref.duration_ms == 1500
    pcm = np.frombuffer(ref.pcm16k, dtype="<i2")
    assert abs(len(pcm) - 24_000) <= 1  # 1.5 s at 16 kHz
    mid = pcm[4000:20000].astype(np.float64) / 32767.0
    want = 0.5 * np.sin(2 * np.pi * 440.0 * np.arange(4000, 20000) / 16000.0)
    assert np.max(np.abs(mid - want)) < 0.05  # the same tone, resampled


@pytest.mark.parametrize("uri", ["data:audio/mpeg;base64," + base64.b64encode(b"ID3 not really mp3").decode(),
                                 "data:audio/wav;base64,AAAA"])
def test_an_undecodable_clip_is_bad_audio(uri: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        check_ref_audio(uri)
    assert exc.value.code == "bad_audio" and exc.value.param == "session.ref_audio"


def test_runtime_config_carries_the_clip_pcm_and_the_seed() -> None:
    cfg, _ = apply_patch(default_config(CTX), {"ref_audio": tone_clip(1.0, hz=440.0, amplitude=0.5, rate=24000), "extra_body": {"seed": 77}},
                         CTX, opening=True, prefix_committed=False)
    rc = derive(cfg, RuntimeDefaults())
    assert rc["seed"] == 77
    assert base64.b64decode(rc["ref_audio"]) == cfg.ref_audio.pcm16k
    assert "min_speak_tokens_before_chunk_boundary" not in rc["thinker"] and "response_token_cap" not in rc["thinker"]
    assert set(rc["talker"]) == {"temperature", "repetition_penalty", "codes_per_unit"}
