"""Checkpoint loader on the tiny checkpoint (model.md §8.5, invariant I15)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from make_tiny_checkpoint import build_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ConfigError, ModelConfig
from engine.loader import CheckpointError, load_checkpoint
from engine.loader.checkpoint import _validate
from engine.model.keys import vpm_layer_keys
from engine.model.minicpmo import MiniCPMO
from engine.tokenizer import TokenizerError

INDEX = "model.safetensors.index.json"
HEAD_G = "tts.head_code.0.parametrizations.weight.original0"
HEAD_V = "tts.head_code.0.parametrizations.weight.original1"


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _variant(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None], *,
             index: bool = True) -> Path:
    """Copy of `src` whose tensors went through `edit` (new keys land in shard 2)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", INDEX, "assets"))
    (dst / "assets").symlink_to(src / "assets", target_is_directory=True)
    owner = json.loads((src / INDEX).read_text())["weight_map"]
    state = _file_tensors(src)
    edit(state)
    shards = sorted(set(owner.values()))
    parts: dict[str, dict[str, torch.Tensor]] = {s: {} for s in shards}
    for k, v in state.items():
        parts[owner.get(k, shards[-1])][k] = v
    for name, part in parts.items():
        save_file(part, str(dst / name))
    if index:
        (dst / INDEX).write_text(json.dumps({"weight_map": {k: s for s, p in parts.items() for k in p}}))
    return dst


def _fused_head(state: dict[str, torch.Tensor]) -> torch.Tensor:
    g, v = state[HEAD_G], state[HEAD_V]
    return g * v / v.norm(dim=1, keepdim=True)  # W = g * v / ||v|| per output row (§1.5)


def test_round_trip_strict(tiny_ckpt: Path) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32)
    file = _file_tensors(tiny_ckpt)
    got = ck.model.state_dict()
    dropped = {"tts.projector_spk", "tts.model.embed_tokens"}
    for key, value in file.items():
        if key in (HEAD_G, HEAD_V) or any(key.startswith(d) for d in dropped):
            continue
        assert torch.equal(got[key], value), key
    torch.testing.assert_close(got["tts.head_code.0.weight"], _fused_head(file), atol=1e-6, rtol=1e-6)
    # The builder draws v ~ N(0, 0.02) and g = ||v||, so the fused W is v itself (§9.4).
    torch.testing.assert_close(got["tts.head_code.0.weight"], file[HEAD_V], atol=1e-6, rtol=1e-6)
    assert ck.token2wav is not None and ck.special_tokens is not None
    assert set(ck.voices()) == {"default"}
    assert ck.voice("default").num_prompt_tokens > 0
    # Non-persistent buffers survive the meta-parameter build (real RoPE tables).
    ref = MiniCPMO(ck.config)
    torch.testing.assert_close(ck.model.llm.inv_freq, ref.llm.inv_freq)


def test_bf16_cast(tiny_ckpt: Path) -> None:
    f32 = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_token2wav=False).model.state_dict()
    ck = load_checkpoint(tiny_ckpt, dtype=torch.bfloat16)
    for key, value in ck.model.named_parameters():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, f32[key].to(torch.bfloat16)), key
    assert all(p.dtype == torch.float32 for p in ck.token2wav.flow.parameters())
    assert all(p.dtype == torch.float32 for p in ck.token2wav.hift.parameters())
    assert ck.model.llm.inv_freq.dtype == torch.float32


def test_missing_wrong_shape_unknown_in_one_error(tiny_ckpt: Path, tmp_path: Path) -> None:
    def edit(s: dict[str, torch.Tensor]) -> None:
        del s["llm.model.layers.1.mlp.up_proj.weight"]
        s["apm.conv1.bias"] = torch.zeros(3)
        s["tts.something_new.weight"] = torch.zeros(2)

    bad = _variant(tiny_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad, dtype=torch.float32)
    msg = str(err.value)
    for name in ("llm.model.layers.1.mlp.up_proj.weight", "apm.conv1.bias", "tts.something_new.weight"):
        assert name in msg
    assert err.value.missing == ["llm.model.layers.1.mlp.up_proj.weight"]
    assert err.value.unexpected == ["tts.something_new.weight"]
    assert len(err.value.wrong_shape) == 1


@pytest.mark.parametrize("kind", ["missing", "wrong_shape", "unknown"])
def test_each_kind_fails(tiny_ckpt: Path, tmp_path: Path, kind: str) -> None:
    key = "tts.model.norm.weight"
    edits = {"missing": lambda s: s.pop(key), "wrong_shape": lambda s: s.update({key: torch.ones(7)}),
             "unknown": lambda s: s.update({"llm.extra": torch.ones(1)})}
    bad = _variant(tiny_ckpt, tmp_path / kind, edits[kind])
    with pytest.raises(CheckpointError, match=key if kind != "unknown" else "llm.extra"):
        load_checkpoint(bad, dtype=torch.float32, with_token2wav=False)


def test_optional_keys_accepted(tiny_ckpt: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_file(tiny_ckpt / "config.json")
    assert cfg.vision is not None and cfg.vision.layers_used == 1

    def edit(s: dict[str, torch.Tensor]) -> None:
        assert "tts.model.embed_tokens.weight" in s and "tts.projector_spk.linear1.weight" in s
        s["llm.model.rotary_emb.inv_freq"] = torch.ones(16)
        s["resampler.pos_embed"] = torch.ones(4, 128)
        # The vision layer dropped by drop_vision_last_layer may be stored (§8.5, U3).
        s |= {k: torch.zeros(shape) for k, shape in vpm_layer_keys(cfg.vision, 1).items()}
        del s["tts.projector_spk.linear2.bias"]  # optional keys may be absent too

    ok = _variant(tiny_ckpt, tmp_path / "opt", edit)
    ck = load_checkpoint(ok, dtype=torch.float32, with_token2wav=False)
    assert "tts.model.embed_tokens.weight" not in ck.model.state_dict()


def test_missing_special_token_fails_load(tiny_ckpt: Path, tmp_path: Path) -> None:
    d = _variant(tiny_ckpt, tmp_path / "tok", lambda s: None)
    for name in ("added_tokens.json", "tokenizer_config.json"):
        data = json.loads((d / name).read_text())
        if name == "added_tokens.json":
            del data["<|chunk_eos|>"]
        else:
            data["added_tokens_decoder"] = {i: e for i, e in data["added_tokens_decoder"].items()
                                            if e["content"] != "<|chunk_eos|>"}
        (d / name).write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=r"<\|chunk_eos\|>"):
        load_checkpoint(d, dtype=torch.float32)


def test_no_vision_drops_vision_keys(tiny_ckpt: Path) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_vision=False, with_token2wav=False)
    assert ck.model.vpm is None and ck.model.resampler is None and ck.config.vision is None
    assert not any(k.startswith(("vpm.", "resampler.")) for k in ck.model.state_dict())


def test_weight_norm_variants_identical(tiny_ckpt: Path, tmp_path: Path) -> None:
    wg = build_tiny_checkpoint(tmp_path / "wg", 0, head_code_format="weight_g")
    assert "tts.head_code.0.weight_g" in _file_tensors(wg)

    def fuse(s: dict[str, torch.Tensor]) -> None:
        s["tts.head_code.0.weight"] = _fused_head(s)
        del s[HEAD_G], s[HEAD_V]

    fused = _variant(tiny_ckpt, tmp_path / "fused", fuse)
    heads = [load_checkpoint(p, dtype=torch.float32, with_token2wav=False).model.tts.head_code[0].weight
             for p in (tiny_ckpt, wg, fused)]
    assert torch.equal(heads[0], heads[1]) and torch.equal(heads[0], heads[2])


def test_shards_without_index_and_duplicates(tiny_ckpt: Path, tmp_path: Path) -> None:
    plain = _variant(tiny_ckpt, tmp_path / "noindex", lambda s: None, index=False)
    load_checkpoint(plain, dtype=torch.float32, with_token2wav=False)
    dup = plain / "model-extra.safetensors"
    save_file({"llm.model.norm.weight": torch.ones(128)}, str(dup))
    with pytest.raises(CheckpointError, match="more than once"):
        load_checkpoint(plain, dtype=torch.float32, with_token2wav=False)


@pytest.mark.parametrize(("path", "value", "field"), [
    (("hidden_size",), "wide", "config.hidden_size"),
    (("tts_config", "num_audio_tokens"), None, "config.tts_config.num_audio_tokens"),
    (("audio_config", "encoder_ffn_dim"), 100, "config.audio_config.encoder_ffn_dim"),
    (("tts_config", "llm_dim"), 256, "config.tts_config.llm_dim"),
    (("audio_pool_step",), 4, "config.audio_pool_step"),
])
def test_bad_config_field_is_named(tiny_ckpt: Path, tmp_path: Path, path: tuple[str, ...],
                                   value: object, field: str) -> None:
    d = tmp_path / "cfg"
    shutil.copytree(tiny_ckpt, d, symlinks=True)
    data = json.loads((d / "config.json").read_text())
    node = data
    for k in path[:-1]:
        node = node[k]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    (d / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_checkpoint(d, dtype=torch.float32)


def test_flow_vocab_must_match_codebook(tiny_ckpt: Path) -> None:
    ck = load_checkpoint(tiny_ckpt, dtype=torch.float32)
    _validate(ck.config, ck.model, ck.token2wav)  # consistent as built
    import dataclasses

    bad_cfg = dataclasses.replace(ck.token2wav.flow_cfg, vocab_size=ck.config.tts.eos_code - 1)
    with pytest.raises(CheckpointError, match="num_audio_tokens"):
        _validate(ck.config, ck.model, dataclasses.replace(ck.token2wav, flow_cfg=bad_cfg))


def test_dummy_mode(tiny_ckpt: Path) -> None:
    a = load_checkpoint(tiny_ckpt, dtype=torch.float32, dummy=True, seed=3).model
    b = load_checkpoint(tiny_ckpt, dtype=torch.float32, dummy=True, seed=3).model
    c = load_checkpoint(tiny_ckpt, dtype=torch.bfloat16, dummy=True, seed=4).model
    real = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_token2wav=False).model
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == real.state_dict().keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k].float()) for k in sa)
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v).all() for v in c.parameters())
    # Recipe (§9.4): norms 1, biases 0, Linear weights N(0, 0.02).
    assert torch.all(sa["llm.model.norm.weight"] == 1) and torch.all(sa["apm.conv1.bias"] == 0)
    assert abs(sa["llm.model.embed_tokens.weight"].std().item() - 0.02) < 2e-3
    torch.testing.assert_close(a.llm.inv_freq, real.llm.inv_freq)


def test_voice_pack_round_trip_and_validation(tiny_ckpt: Path, tmp_path: Path) -> None:
    from engine.voice import VoicePack, VoicePackError, load_voice, make_random_voice

    codebook = load_checkpoint(tiny_ckpt, dtype=torch.float32, with_token2wav=False).config.tts.eos_code
    v = make_random_voice(5, codebook=codebook, voice_id="alice")
    again = load_voice(v.save(tmp_path / "alice.safetensors"), codebook=codebook)
    assert again.voice_id == "alice" and again.metadata["ref_sample_rate"] == "16000"
    assert all(torch.equal(a, b) for a, b in zip(v.tensors().values(), again.tensors().values(), strict=True))
    assert torch.equal(make_random_voice(5, codebook=codebook).prompt_mel, v.prompt_mel)
    t = v.tensors()
    bad = {"prompt_mel": t["prompt_mel"][:-1], "spk_embedding": t["spk_embedding"].double(),
           "prompt_tokens": t["prompt_tokens"].long(), "ref_audio_16k": t["ref_audio_16k"][None]}
    for name, value in bad.items():
        with pytest.raises(VoicePackError, match=name):
            VoicePack(voice_id="x", **(t | {name: value}))
    out_of_range = t | {"prompt_tokens": torch.full_like(t["prompt_tokens"], codebook)}
    save_file(out_of_range, str(tmp_path / "oor.safetensors"))
    with pytest.raises(VoicePackError, match="prompt_tokens"):
        load_voice(tmp_path / "oor.safetensors", codebook=codebook)
