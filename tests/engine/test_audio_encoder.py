"""Whisper encoder: parity with transformers, streaming == offline (I1), KV reset (I2), 10 per unit (I3)."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder as HFWhisperEncoder

from engine.config import AudioConfig
from engine.model.audio import AudioProjector, WhisperEncoder, block_causal_mask, pooled_length

POOL = 5
BLOCK = 50  # encoder frames per second (audio_chunk_length = 1.0)


def tiny_audio(max_source_positions: int = 1500) -> AudioConfig:
    return AudioConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256,
                       num_mel_bins=80, max_source_positions=max_source_positions)


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    """Seeded non-trivial weights (biases and norms too, so that every tensor matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            base = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
            p.copy_(base + std * torch.randn(p.shape, generator=g))
    return module.eval()


def build(max_source_positions: int = 1500, seed: int = 0) -> tuple[WhisperEncoder, AudioProjector]:
    enc = randomize_(WhisperEncoder(tiny_audio(max_source_positions)), seed)
    proj = randomize_(AudioProjector(64, 128), seed + 1)
    return enc, proj


def stream_unit(enc: WhisperEncoder, proj: AudioProjector, mel: torch.Tensor, k: int, cache) -> torch.Tensor:
    """§2.4 slicing of unit k from a mel with 100K + 2 frames: [0, 102), then [100k - 2, 100k + 102)."""
    start, stop = max(0, 100 * k - 2), 100 * k + 102
    hidden = enc.forward_stream(mel[None, :, start:stop], cache, 100 * k - start, 2)
    return proj.embed(hidden, POOL)[0]  # [10, 128]


def stream_units(enc: WhisperEncoder, proj: AudioProjector, mel: torch.Tensor, units: int) -> list[torch.Tensor]:
    cache = enc.allocate_cache()
    return [stream_unit(enc, proj, mel, k, cache) for k in range(units)]


def test_state_dict_keys_match_checkpoint_layout() -> None:
    enc, proj = build()
    keys = set(enc.state_dict())
    assert {"conv1.weight", "conv2.bias", "embed_positions.weight", "layer_norm.weight",
            "layers.1.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.weight",
            "layers.0.fc1.weight", "layers.1.final_layer_norm.bias"} <= keys
    assert "layers.0.self_attn.k_proj.bias" not in keys
    assert enc.state_dict()["embed_positions.weight"].shape == (1500, 64)
    assert set(proj.state_dict()) == {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}


def test_offline_matches_transformers_whisper_encoder() -> None:
    enc, _ = build()
    hf_cfg = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256,
                           num_mel_bins=80, max_source_positions=1500, activation_function="gelu",
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    hf = HFWhisperEncoder(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(enc.state_dict(), strict=False)
    assert not unexpected and all("k_proj.bias" in k for k in missing)
    for name, p in hf.named_parameters():  # HF's k_proj carries a bias: pin it to zero
        if name.endswith("k_proj.bias"):
            torch.nn.init.zeros_(p)
    mel = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(1))  # HF insists on 30 s
    with torch.no_grad():
        ref = hf(mel).last_hidden_state
        ours = enc(mel)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("units", [1, 4, 29])
def test_streaming_equals_block_causal_offline(units: int) -> None:
    """I1: K units in one cache window == offline over 100K + 2 frames with the 50-frame block mask."""
    enc, proj = build(seed=2)
    mel = torch.randn(80, 100 * units + 2, generator=torch.Generator().manual_seed(units))
    with torch.no_grad():
        streamed = torch.cat(stream_units(enc, proj, mel, units))
        offline = proj.embed(enc(mel[None], block=BLOCK), POOL)[0, : 10 * units]
    assert streamed.shape == (10 * units, 128)
    torch.testing.assert_close(streamed, offline, atol=1e-5, rtol=1e-5)


def test_block_mask_is_not_a_no_op() -> None:
    """The comparison above must be able to fail: full attention differs from the block mask."""
    enc, proj = build(seed=2)
    mel = torch.randn(80, 302, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        streamed = torch.cat(stream_units(enc, proj, mel, 3))
        full = proj.embed(enc(mel[None]), POOL)[0, :30]
    assert (streamed - full).abs().max() > 1e-3


def test_kv_reset_rule_with_200_positions() -> None:
    """I2: with max_source_positions 200 the cache resets at units 3, 6, ... and restarts positions at 0."""
    enc, proj = build(max_source_positions=200, seed=3)
    mel = torch.randn(80, 100 * 8 + 2, generator=torch.Generator().manual_seed(4))
    cache = enc.allocate_cache()
    lengths, resets = [], []
    with torch.no_grad():
        outs = []
        for k in range(8):
            before = cache.resets
            outs.append(stream_unit(enc, proj, mel, k, cache))
            lengths.append(cache.length)
            resets.append(cache.resets > before)
        assert [k for k, r in enumerate(resets) if r] == [3, 6]
        assert lengths == [50, 100, 150, 50, 100, 150, 50, 100]
        for k in (3, 6):  # a post-reset unit == a fresh encoder fed the same slice (left_extra 2, pos 0)
            fresh = enc.allocate_cache()
            hidden = enc.forward_stream(mel[None, :, 100 * k - 2: 100 * k + 102], fresh, 2, 2)
            torch.testing.assert_close(outs[k], proj.embed(hidden, POOL)[0], atol=1e-6, rtol=1e-6)
        assert (outs[4] - outs[1]).abs().max() > 1e-3  # sanity: units are not trivially equal


def test_exactly_ten_embeddings_per_unit() -> None:
    """I3 at the encoder level: unit 0 (102 frames), later units (104) and post-reset units."""
    assert pooled_length(102, POOL) == pooled_length(104, POOL) == 10
    enc, proj = build(max_source_positions=200, seed=5)
    mel = torch.randn(80, 100 * 5 + 2, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert [u.shape for u in stream_units(enc, proj, mel, 5)] == [torch.Size([10, 128])] * 5


def test_padding_mask_isolates_padded_frames() -> None:
    """Offline batch with a shorter item equals that item alone (keys past its length are masked)."""
    enc, _ = build(seed=6)
    mel = torch.randn(2, 80, 300, generator=torch.Generator().manual_seed(6))
    mel[1, :, 200:] = 0.0
    lengths = torch.tensor([150, 100])
    with torch.no_grad():
        batched = enc(mel, lengths=lengths, block=BLOCK)
        alone = enc(mel[1:, :, :200], block=BLOCK)
    torch.testing.assert_close(batched[1, :100], alone[0, :100], atol=1e-5, rtol=1e-5)
    mask = block_causal_mask(4, 2, torch.tensor([3]))
    assert mask[0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]


def test_seeded_determinism() -> None:
    a_enc, a_proj = build(seed=9)
    b_enc, b_proj = build(seed=9)
    mel = torch.randn(80, 302, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = torch.cat(stream_units(a_enc, a_proj, mel, 3))
        b = torch.cat(stream_units(b_enc, b_proj, mel, 3))
    assert torch.equal(a, b)
