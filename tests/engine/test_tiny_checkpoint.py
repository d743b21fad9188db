"""The tiny-checkpoint builder (model.md §9.2-§9.4) and the key spec (§8.3, invariant I15)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from make_tiny_checkpoint import SHARDS, build_tiny_checkpoint, main
from safetensors import safe_open
from tiny_checkpoint_files import TINY_CONFIG

from engine.config import ModelConfig
from engine.model.keys import expected_keys, module_keys, optional_keys
from engine.model.minicpmo import MiniCPMO
from engine.voice import load_voice

EXPECTED_FILES = {
    "config.json", "preprocessor_config.json", "generation_config.json", "vocab.json", "merges.txt",
    "added_tokens.json", "special_tokens_map.json", "tokenizer_config.json", *SHARDS,
    "model.safetensors.index.json", "assets/token2wav/flow.yaml", "assets/token2wav/flow.pt",
    "assets/token2wav/hift.pt", "assets/token2wav/speech_tokenizer_v2_25hz.onnx", "assets/token2wav/campplus.onnx",
    "voices/default.safetensors",
}
MAX_BYTES = 24 * 2**20  # "a few MB" (§9.2 main ≈ 3.77 M fp32 parameters incl. unused embeddings)

# The real config.json values of model.md §8.2 (flat Qwen3 fields plus nested configs).
REAL_OVERRIDES = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151748,
}
REAL_AUDIO = {"d_model": 1024, "encoder_layers": 24, "encoder_attention_heads": 16, "encoder_ffn_dim": 4096}
REAL_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
               "num_attention_heads": 16, "image_size": 980}
REAL_TTS = {"llm_dim": 4096, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 20,
            "num_attention_heads": 12, "num_key_value_heads": 12, "num_text_tokens": 152064,
            "audio_bos_token_id": 151687, "text_eos_token_id": 151692}


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_byte_identical_for_same_seed(tmp_path: Path) -> None:
    a = build_tiny_checkpoint(tmp_path / "a", 7)
    assert main(["--out", str(tmp_path / "b"), "--seed", "7"]) == 0
    c = build_tiny_checkpoint(tmp_path / "c", 8)
    da, db, dc = _digests(a), _digests(tmp_path / "b"), _digests(c)
    assert set(da) == EXPECTED_FILES
    assert da == db
    assert da[SHARDS[0]] != dc[SHARDS[0]] and da["config.json"] == dc["config.json"]
    assert sum(p.stat().st_size for p in a.rglob("*") if p.is_file()) < MAX_BYTES


def test_tiny_keys_match_spec(tiny_ckpt: Path) -> None:
    cfg = ModelConfig.from_file(tiny_ckpt / "config.json")
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(SHARDS)
    shapes = {}
    for shard in SHARDS:
        with safe_open(str(tiny_ckpt / shard), framework="pt") as f:
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())
    optional = optional_keys(cfg)
    assert {k: v for k, v in shapes.items() if k not in optional} == expected_keys(cfg)
    assert "tts.model.embed_tokens.weight" in shapes
    assert shapes["tts.head_code.0.parametrizations.weight.original0"] == (cfg.tts.num_audio_tokens, 1)


def test_tiny_config_and_voice(tiny_ckpt: Path) -> None:
    cfg = ModelConfig.from_file(tiny_ckpt / "config.json")
    assert (cfg.llm.hidden_size, cfg.llm.vocab_size, cfg.tts.num_text_tokens) == (128, 320, 320)
    tc = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    assert tc["bad_token_ids"] == [0, 1, 2] and tc["eos_token"] == "<|im_end|>"
    added = json.loads((tiny_ckpt / "added_tokens.json").read_text())
    assert sorted(added.values()) == list(range(256, 256 + len(added)))
    assert all(e["special"] for e in tc["added_tokens_decoder"].values())
    voice = load_voice(tiny_ckpt / "voices" / "default.safetensors", codebook=cfg.tts.eos_code)
    assert voice.prompt_mel.shape == (2 * voice.num_prompt_tokens, 80)


def _real_config() -> ModelConfig:
    data = json.loads(json.dumps(TINY_CONFIG)) | REAL_OVERRIDES
    data["audio_config"] |= REAL_AUDIO
    data["vision_config"] |= REAL_VISION
    data["tts_config"] |= REAL_TTS
    return ModelConfig.from_dict(data)


def test_real_size_meta_build_matches_spec() -> None:
    """I15: MiniCPMO at the real §8.2 sizes holds exactly the §8.3 keys and shapes."""
    cfg = _real_config()
    with torch.device("meta"):
        model = MiniCPMO(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = module_keys(cfg)
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    assert {k: v for k, v in got.items() if want[k] != v} == {}
    # Spot checks against the literal §8.3 table.
    assert want["llm.model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert want["vpm.embeddings.position_embedding.weight"] == (4900, 1152)
    assert "vpm.encoder.layers.25.mlp.fc2.weight" in want and "vpm.encoder.layers.26.mlp.fc2.weight" not in want
    assert want["resampler.attn.in_proj_weight"] == (12288, 4096)
    assert want["tts.emb_text.weight"] == (152064, 768) and want["tts.head_code.0.weight"] == (6562, 768)
    assert expected_keys(cfg)["tts.head_code.0.parametrizations.weight.original0"] == (6562, 1)
    assert "apm.layers.0.self_attn.k_proj.bias" not in want
    n_params = sum(v.numel() for v in model.parameters())
    # §1.1 counts minus what the module does not hold: tts.model.embed_tokens, projector_spk and the
    # weight-norm g of head_code (fused into one weight, [num_audio_tokens, 1]).
    spec = 8_189_195_264 + 307_216_384 + 20_979_712 + 402_552_736 + 88_907_776 + 347_696_290
    assert n_params == spec - 24_576_000 - 3_737_088 - cfg.tts.num_audio_tokens
