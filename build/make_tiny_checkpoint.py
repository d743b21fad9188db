"""Write the seeded tiny MiniCPM-o 4.5 checkpoint (`tiny-minicpmo45`, model.md §9.2-§9.4).

Same file layout, config schema and key names as the real checkpoint, a few MB, byte-identical for the
same seed and options. Generated on demand (tests build it into a tmp dir); never committed.

    python build/make_tiny_checkpoint.py --out DIR --seed N [--no-vision] [--no-prompt-models]
                                         [--head-code-format weight_g]

`--no-prompt-models` leaves out the two voice-prompt ONNX models (a checkpoint whose voices are only its packs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# NOTE: `build` is also the name of a common PyPI package, so neither this script nor its sibling is
# imported as `build.<module>`: the repo root (for `engine`) and this folder go on sys.path instead.
_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from tiny_checkpoint_files import TINY_CONFIG, generation_config, preprocessor_config, tokenizer_files  # noqa: E402
from tiny_prompt_models import write_tiny_prompt_models  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.model.keys import optional_keys  # noqa: E402
from engine.model.minicpmo import MiniCPMO, init_weights_  # noqa: E402
from engine.voice import make_random_voice  # noqa: E402
from engine.weights import INIT_STD, split_weight_norm  # noqa: E402

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
# Shard 1 holds the thinker's text/audio weights, shard 2 everything else (exercises the index).
SHARD1_PREFIXES = ("llm.", "apm.", "audio_projection_layer.")
VOICE_SEED = 1
HEAD_CODE_NAMES = {"parametrizations": ("parametrizations.weight.original0",
                                        "parametrizations.weight.original1"),
                   "weight_g": ("weight_g", "weight_v")}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def checkpoint_state(cfg: ModelConfig, seed: int, head_code_format: str) -> dict[str, torch.Tensor]:
    """File-side tensors: module weights (§9.4 recipe), head_code split into g/v, optional keys."""
    with torch.random.fork_rng(devices=[]):
        # Constructors draw default inits from the global RNG; init_weights_ overwrites every stored
        # tensor, but seed anyway so nothing can depend on the caller's RNG state (left untouched).
        torch.manual_seed(seed)
        model = MiniCPMO(cfg)
    gen = torch.Generator().manual_seed(seed)
    init_weights_(model, gen)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if head_code_format != "fused":
        g_name, v_name = HEAD_CODE_NAMES[head_code_format]
        for q in range(cfg.tts.num_vq):
            g, v = split_weight_norm(state.pop(f"tts.head_code.{q}.weight"))
            state[f"tts.head_code.{q}.{g_name}"] = g.contiguous()
            state[f"tts.head_code.{q}.{v_name}"] = v.contiguous()
    # The real file also ships unused keys the loader must accept and drop (§8.5).
    for key, shape in sorted(optional_keys(cfg).items()):
        if key.startswith("tts."):
            noise = torch.randn(shape, generator=gen) * INIT_STD
            state[key] = torch.zeros(shape) if key.endswith(".bias") else noise
    return state


def _write_shards(out: Path, state: dict[str, torch.Tensor]) -> None:
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    for key in sorted(state):
        parts[0 if key.startswith(SHARD1_PREFIXES) else 1][key] = state[key]
    weight_map: dict[str, str] = {}
    for name, part in zip(SHARDS, parts, strict=True):
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def build_tiny_checkpoint(out: Path, seed: int = 0, *, vision: bool = True,
                          head_code_format: str = "parametrizations", prompt_models: bool = True) -> Path:
    """Write the tiny checkpoint into `out` (created if needed) and return it."""
    if head_code_format not in (*HEAD_CODE_NAMES, "fused"):
        raise ValueError(f"head_code_format: unknown {head_code_format!r}")
    from engine.token2wav.assets import write_tiny_token2wav_assets

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(TINY_CONFIG))
    config["init_vision"] = vision
    if not vision:
        config.pop("vision_config")
    tok_files = tokenizer_files()
    ids = tok_files["added_tokens.json"]
    config["bos_token_id"], config["eos_token_id"] = ids["<|endoftext|>"], ids["<|im_end|>"]
    _write_json(out / "preprocessor_config.json", preprocessor_config())
    _write_json(out / "generation_config.json", generation_config(ids))
    for name, content in tok_files.items():
        if isinstance(content, str):
            (out / name).write_text(content, encoding="utf-8")
        else:
            _write_json(out / name, content)
    cfg = ModelConfig.from_dict(config)
    _write_shards(out, checkpoint_state(cfg, seed, head_code_format))
    write_tiny_token2wav_assets(out / "assets" / "token2wav", seed)
    if prompt_models:
        write_tiny_prompt_models(out / "assets" / "token2wav", seed)
    voice = make_random_voice(VOICE_SEED, codebook=cfg.tts.eos_code, voice_id="default")
    voice.save(out / "voices" / "default.safetensors")
    # Written last: callers may treat an existing config.json as "checkpoint complete".
    _write_json(out / "config.json", config)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vision", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prompt-models", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--head-code-format", choices=[*HEAD_CODE_NAMES, "fused"], default="parametrizations")
    args = ap.parse_args(argv)
    path = build_tiny_checkpoint(args.out, args.seed, vision=args.vision,
                                 head_code_format=args.head_code_format, prompt_models=args.prompt_models)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"wrote {path} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
