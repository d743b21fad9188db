"""A voice pack from a clip (model.md §6.1): features, the two ONNX models, the pack schema, bad clips."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loader.checkpoint import TOKEN2WAV_DIR
from engine.token2wav.features import flow_mel, kaldi_fbank, resample, tokenizer_mel
from engine.token2wav.prompt import (
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILE,
    ClipError,
    PromptModels,
    load_prompt_models,
    voice_from_clip,
)
from engine.voice import load_voice, validate_tensors

CODEBOOK = 6561


def clip(seconds: float, seed: int, scale: float = 0.1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(seconds * 16_000), generator=g) * scale


@pytest.fixture(scope="module")
def models(tiny_ckpt: Path) -> PromptModels:
    got, why = load_prompt_models(tiny_ckpt / TOKEN2WAV_DIR)
    assert got is not None, why
    return got


def test_the_tiny_onnx_models_have_the_real_names_and_ranks(models: PromptModels) -> None:
    tok_in = [(i.name, len(i.shape), i.type) for i in models.tokenizer.get_inputs()]
    assert tok_in == [("feats", 3, "tensor(float)"), ("feats_length", 1, "tensor(int32)")]
    assert [(o.name, len(o.shape)) for o in models.tokenizer.get_outputs()] == [("indices", 2)]
    assert [(i.name, len(i.shape)) for i in models.campplus.get_inputs()] == [("input", 3)]
    assert [(o.name, len(o.shape)) for o in models.campplus.get_outputs()] == [("output", 2)]


def test_the_tiny_onnx_files_are_seeded(tmp_path: Path, tiny_ckpt: Path) -> None:
    from tiny_prompt_models import write_tiny_prompt_models

    write_tiny_prompt_models(tmp_path / "a", 0)
    write_tiny_prompt_models(tmp_path / "b", 1)
    for name in (SPEECH_TOKENIZER_FILE, CAMPPLUS_FILE):
        same = (tmp_path / "a" / name).read_bytes()
        assert same == (tiny_ckpt / TOKEN2WAV_DIR / name).read_bytes()
        assert same != (tmp_path / "b" / name).read_bytes()


def test_voice_from_clip_is_a_voice_pack(models: PromptModels, tmp_path: Path) -> None:
    wav = clip(2.0, seed=3)
    pack = voice_from_clip(models, wav, voice_id="mine")
    assert pack.prompt_tokens.dtype == torch.int32 and pack.prompt_tokens.shape == (50,)  # 25 Hz
    assert pack.spk_embedding.dtype == torch.float32 and pack.spk_embedding.shape == (192,)
    assert pack.prompt_mel.dtype == torch.float32 and pack.prompt_mel.shape == (100, 80)  # 2 * P_tok
    assert torch.equal(pack.ref_audio_16k, wav)
    validate_tensors(pack.tensors(), "pack", codebook=CODEBOOK)
    again = load_voice(pack.save(tmp_path / "mine.safetensors"), codebook=CODEBOOK)
    assert all(torch.equal(a, b) for a, b in zip(again.tensors().values(), pack.tensors().values(), strict=True))
    other = voice_from_clip(models, clip(2.0, seed=4))
    assert not torch.equal(other.spk_embedding, pack.spk_embedding)
    assert not torch.equal(other.prompt_tokens, pack.prompt_tokens)


def test_the_vocoder_prompt_is_cut_to_the_pool_cap_and_the_prefix_clip_is_not(models: PromptModels) -> None:
    wav = clip(12.0, seed=5)
    pack = voice_from_clip(models, wav, max_prompt_frames=500)
    assert pack.prompt_tokens.shape == (250,) and pack.prompt_mel.shape == (500, 80)
    assert pack.ref_audio_16k.numel() == wav.numel()


@pytest.mark.parametrize("wav,match", [
    (clip(0.2, seed=1), "at least"),
    (torch.zeros(32_000), "silent"),
    (clip(2.0, seed=1, scale=1e-5), "silent"),
    (torch.full((32_000,), float("nan")), "non-finite"),
])
def test_a_clip_that_makes_no_voice_is_a_typed_error(models: PromptModels, wav: torch.Tensor, match: str) -> None:
    with pytest.raises(ClipError, match=match) as err:
        voice_from_clip(models, wav)
    assert err.value.code == "bad_audio"


def test_no_onnx_files_means_no_prompt_models(tmp_path: Path) -> None:
    got, why = load_prompt_models(tmp_path)
    assert got is None and SPEECH_TOKENIZER_FILE in why and CAMPPLUS_FILE in why


def _sine(hz: float, rate: int, seconds: float) -> torch.Tensor:
    t = torch.arange(int(rate * seconds), dtype=torch.float64) / rate
    return (0.5 * torch.sin(2 * math.pi * hz * t)).float()


def test_resample_keeps_a_tone() -> None:
    got = resample(_sine(1000.0, 16_000, 0.5), 16_000, 24_000)
    want = _sine(1000.0, 24_000, 0.5)
    assert got.shape == want.shape
    assert (got[200:-200] - want[200:-200]).abs().max() < 1e-3  # away from the zero-padded edges


def test_each_mel_puts_a_tone_in_the_right_bin() -> None:
    tone = _sine(1000.0, 16_000, 1.0)
    fbank = kaldi_fbank(tone)  # Kaldi mel: 1127 ln(1 + f / 700), 20 Hz - 8 kHz, 81 steps
    assert fbank.shape == (1 + (16_000 - 400) // 160, 80)
    lo, hi = 1127 * math.log1p(20 / 700), 1127 * math.log1p(8000 / 700)
    centers = [700 * (math.exp((lo + (b + 1) * (hi - lo) / 81) / 1127) - 1) for b in range(80)]
    assert int(fbank.mean(0).argmax()) == int(np.argmin([abs(c - 1000.0) for c in centers]))
    assert tokenizer_mel(tone).shape == (128, 100)
    mel = flow_mel(resample(tone, 16_000, 24_000))
    assert mel.shape == (50, 80)
    peak = int(mel.mean(0).argmax())
    assert 0 < peak < 79 and mel.mean(0)[peak] > mel.mean(0).median() + 5  # a clear peak, natural log
