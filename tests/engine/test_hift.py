"""HiFT parity with the Step-Audio2 `HiFTGenerator` (tiny, fp32, same weights, same NSF draws)."""

from __future__ import annotations

import pytest
import torch

from engine.token2wav.assets import TINY_HIFT, build_tiny_modules, hift_file_state, hift_state_from_file
from engine.token2wav.hift import HiFT, draw_nsf
from tests.engine.test_token2wav_refutil import build_ref_hift


@pytest.fixture(scope="module")
def pair():
    _, hift = build_tiny_modules(seed=7)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in hift.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0, generator=gen)      # Snake alpha != 1 so a wrong formula shows
            elif p.dim() >= 2:
                p.mul_(4.0)
        # a voiced F0 (> 10 Hz) on part of the frames so the harmonic branch is exercised
        hift.f0_predictor.classifier.bias.fill_(10.0)
        hift.f0_predictor.classifier.weight.mul_(200.0)
    return hift.eval(), build_ref_hift(hift)


@pytest.mark.parametrize("frames,cache", [(10, 0), (14, 3840)])
def test_hift_matches_reference(pair, frames, cache):
    ours, ref = pair
    g = torch.Generator().manual_seed(frames)
    mel = torch.randn(1, 80, frames, generator=g)
    cache_source = torch.randn(1, 1, cache, generator=g) * 0.1
    torch.manual_seed(11)
    speech_r, source_r = ref(mel, cache_source)
    rand_ini, noise = draw_nsf(torch.Generator().manual_seed(11), frames, TINY_HIFT, torch.device("cpu"))
    speech, source = ours(mel, cache_source, rand_ini, noise)
    assert speech.shape == (1, frames * 480)
    with torch.no_grad():
        f0 = ours.f0_predictor(mel)
    assert (f0 > 10).any() and (f0 <= 10).any()
    torch.testing.assert_close(source, source_r, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(speech, speech_r, atol=1e-5, rtol=1e-4)
    assert speech.abs().max() > 1e-3


def test_batched_rows_equal_single(pair):
    ours, _ = pair
    g = torch.Generator().manual_seed(3)
    mel = torch.randn(3, 80, 6, generator=g)
    draws = [draw_nsf(torch.Generator().manual_seed(i), 6, TINY_HIFT, torch.device("cpu")) for i in range(3)]
    ini = torch.cat([d[0] for d in draws])
    noise = torch.cat([d[1] for d in draws])
    speech, _ = ours(mel, torch.zeros(3, 1, 0), ini, noise)
    for i in range(3):
        one, _ = ours(mel[i:i + 1], torch.zeros(1, 1, 0), *draws[i])
        torch.testing.assert_close(speech[i:i + 1], one, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("legacy", [False, True])
def test_weight_norm_variants_fuse_equal(pair, legacy):
    ours, _ = pair
    state = hift_file_state(ours)
    if legacy:
        state = {k.replace(".parametrizations.weight.original0", ".weight_g")
                  .replace(".parametrizations.weight.original1", ".weight_v"): v for k, v in state.items()}
    fused = hift_state_from_file(state)
    other = HiFT(TINY_HIFT)
    other.load_state_dict(fused, strict=True)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(other.state_dict()[k], v, atol=1e-7, rtol=1e-6)
