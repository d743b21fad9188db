"""The loader recomputes RoPE tables after its meta-device build (dummy and real mode).

A dummy-built model and a normally constructed one that holds the same weights must give identical
TTS (and LLM) forward outputs: `inv_freq` is a non-persistent buffer that neither the checkpoint nor
the §9.4 recipe fills, so only `reset_rope_` makes it right after a meta build.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.loader.checkpoint as checkpoint
from engine.loader import load_checkpoint
from engine.model.layers import SlotKVCache
from engine.model.llm import Qwen3LLM
from engine.model.minicpmo import MiniCPMO
from engine.model.tts import TTSModel

ROWS, STEPS = 9, 4  # condition rows of one unit, then single-code steps


def _normal_tts(dummy: TTSModel, dtype: torch.dtype) -> TTSModel:
    """An ordinary (non-meta) TTSModel holding the dummy model's weights."""
    model = TTSModel(dummy.cfg).to(dtype)
    model.load_state_dict(dummy.state_dict(), strict=True)
    return model.eval()


def _tts_outputs(model: TTSModel, dtype: torch.dtype) -> list[torch.Tensor]:
    """Condition prefill at positions 0..ROWS-1, then STEPS single codes; hidden states and logits."""
    c = model.cfg
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, c.num_text_tokens, (1, ROWS), generator=g)
    hidden = torch.randn(1, ROWS, c.llm_dim, generator=g).to(dtype)
    codes = torch.randint(0, c.num_audio_tokens, (STEPS,), generator=g)
    kv = SlotKVCache.allocate(c, 2, 32, dtype=dtype)
    slot = torch.tensor([1])
    outs = []
    with torch.no_grad():
        h = model(model.condition(ids, hidden), torch.arange(ROWS)[None], slot, kv)  # [1, ROWS, H]
        outs += [h, model.logits(h[:, -1])]
        for t in range(STEPS):
            h = model(model.embed_codes(codes[t:t + 1])[None], torch.tensor([[ROWS + t]]), slot, kv)
            outs += [h, model.logits(h[:, 0])]
    return outs


def _llm_output(model: Qwen3LLM) -> torch.Tensor:
    kv = SlotKVCache.allocate(model.cfg, 1, 16, dtype=torch.float32)
    x = torch.randn(1, 6, model.cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        return model(x, torch.arange(6)[None] + 3, torch.tensor([0]), kv)


def _assert_same_tts(dummy: TTSModel, dtype: torch.dtype) -> None:
    normal = _normal_tts(dummy, dtype)
    for got, want in zip(_tts_outputs(dummy, dtype), _tts_outputs(normal, dtype), strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_build_matches_normal_build(tiny_ckpt: Path, dtype: torch.dtype) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=dtype, dummy=True, seed=5, with_token2wav=False)
    assert ck.model.tts.inv_freq.dtype == torch.float32 and ck.model.llm.inv_freq.dtype == torch.float32
    _assert_same_tts(ck.model.tts, dtype)


def test_loader_resets_rope_after_meta_build(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A skeleton whose RoPE buffers hold garbage (as after `to_empty`) still loads correctly."""
    build = checkpoint.build_skeleton

    def garbage_rope_skeleton(cfg: object) -> MiniCPMO:
        model = build(cfg)
        model.llm.inv_freq = torch.full_like(model.llm.inv_freq, float("nan"))
        model.tts.inv_freq = torch.full_like(model.tts.inv_freq, float("nan"))
        return model

    monkeypatch.setattr(checkpoint, "build_skeleton", garbage_rope_skeleton)
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, dummy=True, seed=5, with_token2wav=False)
    _assert_same_tts(ck.model.tts, torch.float32)
    normal_llm = Qwen3LLM(ck.config.llm)
    normal_llm.load_state_dict(ck.model.llm.state_dict(), strict=True)
    assert torch.equal(_llm_output(ck.model.llm), _llm_output(normal_llm.eval()))
    real = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_token2wav=False).model  # real mode too
    assert torch.equal(real.tts.inv_freq, TTSModel(real.cfg.tts).inv_freq)
    assert torch.equal(real.llm.inv_freq, normal_llm.inv_freq)
