"""build/make_full_checkpoint.py: the full-size key plan matches the modules, the tiny-size output loads
through the real (strict) loader, and the full-size tokenizer/config pass the loader's checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "build"))

import make_full_checkpoint as mfc  # noqa: E402
from make_tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.loader import ShardIndex, load_checkpoint  # noqa: E402
from engine.model.keys import optional_keys  # noqa: E402
from engine.model.minicpmo import build_skeleton  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402


def _fused(plan_keys: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, shape in plan_keys.items():
        if key.endswith(mfc.G_SUFFIX):
            continue
        if key.endswith(mfc.V_SUFFIX):
            key = key[: -len(mfc.V_SUFFIX)] + ".weight"
        out[key] = shape
    return out


def test_full_size_meta_plan_matches_the_module_parameters() -> None:
    done = subprocess.run([sys.executable, str(REPO / "build" / "make_full_checkpoint.py"), "--meta"],
                          capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["dtype"] for r in rows} == {"BF16"} and max(r["shard"] for r in rows) >= 2
    cfg = ModelConfig.from_dict(mfc.full_config())
    optional = optional_keys(cfg)
    plan = {r["key"]: tuple(r["shape"]) for r in rows if r["key"] not in optional}
    skeleton = build_skeleton(cfg)  # parameters on meta: no memory for 9 B parameters
    params = {k: tuple(p.shape) for k, p in skeleton.named_parameters()}
    assert _fused(plan) == params
    assert plan["llm.model.embed_tokens.weight"] == (151748, 4096)
    assert plan["tts.emb_text.weight"] == (152064, 768)


def test_tiny_size_output_loads_strictly_and_has_the_tiny_layout(tmp_path: Path) -> None:
    out = mfc.build_checkpoint(tmp_path / "ckpt", size="tiny", seed=3, shard_bytes=2_000_000)
    index = ShardIndex.from_dir(out)
    assert len({e.file for e in index.entries.values()}) >= 2  # sharded, through the index
    tiny = ShardIndex.from_dir(build_tiny_checkpoint(tmp_path / "tiny", 0))
    cfg = ModelConfig.from_file(out / "config.json")
    assert index.keys() - tiny.keys() == {k for k in optional_keys(cfg) if k.startswith("vpm.")}
    assert all(index.entries[k].shape == tiny.entries[k].shape for k in tiny.keys())
    ck = load_checkpoint(out, device="cpu", dtype=torch.float32)
    weights = [p for p in ck.model.parameters() if p.dim() == 2]
    assert all(p.abs().sum() > 0 for p in weights)  # random, never zeros
    assert ck.voice("default").prompt_tokens.numel() > 0


def test_same_seed_same_tensor_and_seeds_differ() -> None:
    cfg = ModelConfig.from_dict(mfc.full_config())
    key = "tts.model.layers.0.mlp.up_proj.weight"
    a = mfc.make_tensor(key, (64, 32), cfg, 0, "cpu")
    assert torch.equal(a, mfc.make_tensor(key, (64, 32), cfg, 0, "cpu"))
    assert not torch.equal(a, mfc.make_tensor(key, (64, 32), cfg, 1, "cpu"))
    assert 0.015 < a.std().item() < 0.025
    g = mfc.make_tensor("tts.head_code.0" + mfc.G_SUFFIX, (6562, 1), cfg, 0, "cpu")
    v = mfc.make_tensor("tts.head_code.0" + mfc.V_SUFFIX, (6562, 768), cfg, 0, "cpu")
    assert torch.allclose(g, v.norm(dim=1, keepdim=True))


def test_full_size_tokenizer_decodes_filler_ids_and_passes_the_checks(tmp_path: Path) -> None:
    files = mfc.filler_tokenizer_files(mfc.REAL_REGULAR_TOKENS)
    for name, content in files.items():
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    config = mfc.full_config()
    tok, special = load_tokenizer(tmp_path, ModelConfig.from_dict(config))
    assert special.listen >= mfc.REAL_REGULAR_TOKENS and len(tok) < 151748
    text = tok.decode([1000, 150000])
    assert text.strip() and text == tok.decode([1000]) + tok.decode([150000])
