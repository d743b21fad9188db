import numpy as np
import pytest
from scipy.signal import resample_poly

from clients.audio import (
    chunk_pcm16,
    decode_audio_payload,
    duration_ms,
    read_wav,
    resample,
    rms,
    to_pcm16,
    write_wav,
)


def test_wav_roundtrip_and_resample_on_read(tmp_path) -> None:
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(24000) * 3000).astype(np.int16)
    path = write_wav(tmp_path / "a.wav", pcm.tobytes(), 24000)
    same, rate = read_wav(path, rate=None)
    assert rate == 24000 and np.array_equal(same, pcm)
    down, rate16 = read_wav(path, rate=16000)
    assert rate16 == 16000 and len(down) == 16000


def test_resample_matches_an_independent_polyphase_reference() -> None:
    t = np.arange(48000) / 48000
    x = to_pcm16(0.5 * np.sin(2 * np.pi * 440 * t).astype(np.float32))
    ours = resample(x, 48000, 16000).astype(np.float64) / 32767
    ref = resample_poly(x.astype(np.float64) / 32767, 1, 3)
    assert len(ours) == len(ref) == 16000
    core = slice(200, -200)  # edges differ by filter design; the passband content must agree
    assert np.max(np.abs(ours[core] - ref[core])) < 0.01


def test_chunking_is_200_ms_and_lossless() -> None:
    pcm = np.arange(16000 + 1000, dtype=np.int16)
    chunks = list(chunk_pcm16(pcm, 16000, 200))
    assert [len(c) for c in chunks[:-1]] == [6400] * 5  # §9.1: 200 ms of pcm16 @ 16 kHz = 6400 B
    assert len(chunks[-1]) == 2000
    assert b"".join(chunks) == pcm.astype("<i2").tobytes()
    assert duration_ms(chunks[0], 16000) == 200.0


def test_stereo_is_mixed_down_and_rms_scale() -> None:
    stereo = np.stack([np.full(100, 0.5, np.float32), np.full(100, -0.5, np.float32)], axis=1)
    assert np.all(to_pcm16(stereo) == 0)
    full = to_pcm16(np.full(100, 0.25, np.float32)).tobytes()
    assert rms(full) == pytest.approx(0.25, abs=1e-4)


def test_decode_rejects_odd_pcm_and_unknown_formats() -> None:
    with pytest.raises(ValueError):
        decode_audio_payload(b"\x00\x01\x02", "pcm16", 24000)
    with pytest.raises(ValueError):
        decode_audio_payload(b"\x00\x01", "g711_ulaw", 8000)
