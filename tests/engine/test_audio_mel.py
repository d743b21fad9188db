"""Mel front end vs transformers' WhisperFeatureExtractor (model.md §2.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import spectrogram, window_function

from engine.audio.mel import FloorMode, LogMel, MelConfig, slaney_mel_filters


@pytest.fixture(scope="module")
def hf() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor()  # Whisper defaults = MiniCPMAAudioProcessor defaults


def _pcm(n: int, seed: int, scale: float = 0.1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16_000
    tone = 0.3 * np.sin(2 * np.pi * 440.0 * t) * (t > 0.2)
    return (tone + scale * rng.standard_normal(n)).astype(np.float32)


def test_filter_bank_matches_transformers(hf: WhisperFeatureExtractor) -> None:
    ours = slaney_mel_filters(MelConfig())
    assert ours.shape == hf.mel_filters.shape == (201, 80)
    np.testing.assert_allclose(ours, hf.mel_filters, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("n", [16_480, 16_559, 48_000])
def test_log_mel_before_floor_matches_numpy_spectrogram(hf: WhisperFeatureExtractor, n: int) -> None:
    wav = _pcm(n, seed=n)
    ref = spectrogram(wav, window_function(400, "hann"), frame_length=400, hop_length=160, power=2.0,
                      mel_filters=hf.mel_filters, log_mel="log10")[:, :-1]  # float64 reference path
    ours = LogMel().raw(torch.from_numpy(wav))
    assert ours.shape == (80, n // 160) == ref.shape
    np.testing.assert_allclose(ours.numpy(), ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("n", [16_480, 96_000])
def test_dynamic_floor_matches_feature_extractor(hf: WhisperFeatureExtractor, n: int) -> None:
    wav = _pcm(n, seed=7)
    ref = hf(wav, sampling_rate=16_000, return_tensors="np", padding=False).input_features[0]
    ours = LogMel()(torch.from_numpy(wav), FloorMode.DYNAMIC)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5, rtol=0)


def test_padded_30s_matches_feature_extractor(hf: WhisperFeatureExtractor) -> None:
    """The §2.6 path: zero-padded to 30 s, dynamic floor over all 3000 frames."""
    wav = _pcm(40_000, seed=3)
    ref = hf(wav, sampling_rate=16_000, return_tensors="np", padding="max_length").input_features[0]
    ours = LogMel()(torch.nn.functional.pad(torch.from_numpy(wav), (0, 480_000 - 40_000)), FloorMode.DYNAMIC)
    assert ours.shape == ref.shape == (80, 3000)
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5, rtol=0)


def test_fixed_floor_is_minus_ten_then_scaled(hf: WhisperFeatureExtractor) -> None:
    wav = _pcm(20_000, seed=5, scale=1e-4)
    wav[:8000] = 0.0  # digital silence reaches the 1e-10 clamp (-10), below any dynamic floor
    lm = LogMel()
    raw = lm.raw(torch.from_numpy(wav))
    fixed = lm.floor_and_scale(raw, FloorMode.FIXED)
    torch.testing.assert_close(fixed, (raw.clamp(min=-10.0) + 4.0) / 4.0, atol=0, rtol=0)
    assert fixed.min().item() == pytest.approx(-1.5)
    dyn = lm.floor_and_scale(raw, FloorMode.DYNAMIC)
    assert dyn.min().item() == pytest.approx((raw.max().item() - 8.0 + 4.0) / 4.0, abs=1e-6)
