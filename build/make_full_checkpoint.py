"""Write a full-size MiniCPM-o 4.5 checkpoint with seeded random weights (benchmarks on the GPU host).

Real key layout and `config.json` schema at the model.md §8.2/§8.3 sizes, sharded safetensors + index
(bf16, as the real file), Token2Wav `flow.pt`/`hift.pt` in fp32 (§8.4), the tiny voice-prompt ONNX stand-ins
where `onnx` is installed, and a 10 s random voice (§9.5).
`duplex serve --checkpoint DIR` loads it like the real checkpoint (real mode, strict key check).

    python build/make_full_checkpoint.py --out /tmp/ckpt [--device cuda] [--seed 0] [--no-vision]
    python build/make_full_checkpoint.py --meta              # key, shape, dtype, shard; writes nothing
    python build/make_full_checkpoint.py --size tiny --out D # same writer at the tiny dims (tests)

Weights: N(0, 0.02) for every matrix, embedding and bias (small, never all-zero), 1 for norm weights,
the resampler `proj` N(0, hidden^-0.5), weight norm g = ||v|| per row (§9.4). Each tensor has its own
generator seeded from (seed, key), so tensors are generated one at a time, on the GPU with
`--device cuda`, and streamed into the shard file: host memory stays at one tensor. The tokenizer is
byte-level with filler tokens up to the real vocabulary (ids decode to text) and the project's special
tokens after them; its ids are not the real ones (nothing may hard-code ids, model.md §9.6 I16).
"""

from __future__ import annotations

import argparse
import copy
import json
import struct
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):  # see make_tiny_checkpoint.py: `build` is a PyPI name
    if _p not in sys.path:
        sys.path.insert(0, _p)

from make_tiny_checkpoint import VOICE_SEED, _write_json  # noqa: E402
from tiny_checkpoint_files import (  # noqa: E402
    BYTE_SYMBOLS,
    TINY_ADDED_TOKENS,
    TINY_CONFIG,
    bytes_to_unicode,
    generation_config,
    preprocessor_config,
    tokenizer_files,
)

from engine.config import ModelConfig  # noqa: E402
from engine.model.keys import expected_keys, optional_keys  # noqa: E402
from engine.voice import make_random_voice  # noqa: E402
from engine.weights import INIT_STD  # noqa: E402

# model.md §8.2 real values (the tiny config carries the same schema and every other field).
FULL_TOP = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151748, "max_window_layers": 36,
            "torch_dtype": "bfloat16", "image_size": 448}
FULL_AUDIO = {"d_model": 1024, "encoder_layers": 24, "encoder_attention_heads": 16, "encoder_ffn_dim": 4096,
              "decoder_layers": 24, "decoder_attention_heads": 16, "decoder_ffn_dim": 4096}
FULL_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
               "patch_size": 14, "image_size": 980}
FULL_TTS = {"llm_dim": 4096, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 20,
            "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 4096,
            "num_audio_tokens": 6562, "num_text_tokens": 152064, "audio_bos_token_id": 151687,
            "text_eos_token_id": 151692}
REAL_REGULAR_TOKENS = 151643  # ids 0..151642 are BPE tokens in the real vocabulary; added tokens follow
VOICE_TOKENS, VOICE_SECONDS = 250, 10.0  # §9.5: a 10 s dummy voice (P = 500 mel frames)
SHARD_BYTES = 5 * 10**9
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
G_SUFFIX, V_SUFFIX = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
RESAMPLER_PROJ = "resampler.proj"
_GB = 1e9

Plan = dict[str, tuple[tuple[int, ...], torch.dtype]]


def full_config() -> dict[str, Any]:
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg.update(FULL_TOP)
    cfg["audio_config"].update(FULL_AUDIO)
    cfg["vision_config"].update(FULL_VISION)
    cfg["tts_config"].update(FULL_TTS)
    return cfg


def filler_tokenizer_files(regular: int) -> dict[str, Any]:
    """The tiny tokenizer's files with `regular - 256` filler tokens before the added tokens."""
    files = tokenizer_files()
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    vocab = {sym: b for b, sym in bytes_to_unicode().items()}
    for i in range(regular - BYTE_SYMBOLS):
        word, n = "", i
        while True:  # bijective base 26: a..z, aa.. - unique, decodes to " <letters>"
            word, n = alphabet[n % 26] + word, n // 26 - 1
            if n < 0:
                break
        vocab["Ġ" + word] = BYTE_SYMBOLS + i
    shift = regular - BYTE_SYMBOLS
    added = {tok: BYTE_SYMBOLS + i + shift for i, tok in enumerate(TINY_ADDED_TOKENS)}
    tok_cfg = files["tokenizer_config.json"]
    tok_cfg["added_tokens_decoder"] = {str(added[v["content"]]): v for v in tok_cfg["added_tokens_decoder"].values()}
    files.update({"vocab.json": vocab, "added_tokens.json": added})
    return files


def checkpoint_plan(cfg: ModelConfig, dtype: torch.dtype) -> Plan:
    """Every key the file holds: required (weight norm as parametrizations) plus the optional ones."""
    shapes = {**optional_keys(cfg), **expected_keys(cfg, "parametrizations")}
    return {k: (shapes[k], dtype) for k in sorted(shapes)}


def make_tensor(key: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, device: str) -> torch.Tensor:
    """The fp32 tensor for `key`, from its own seeded generator (independent of generation order)."""
    if key.endswith(G_SUFFIX):  # g = ||v|| per output row, so the fused weight equals v
        v_key = key[: -len(G_SUFFIX)] + V_SUFFIX
        v = make_tensor(v_key, (shape[0], cfg.tts.hidden_size), cfg, seed, device)
        return v.flatten(1).norm(dim=1, keepdim=True)
    if len(shape) == 1 and key.endswith(".weight"):  # every 1-D weight is a norm's
        return torch.ones(shape, device=device)
    std = cfg.llm.hidden_size ** -0.5 if key == RESAMPLER_PROJ else INIT_STD
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen, device=device).mul_(std)


def plan_shards(plan: Plan, shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, (shape, dtype) in plan.items():
        nbytes = _numel(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors(path: Path, keys: list[str], plan: Plan, make: Callable[[str], torch.Tensor]) -> int:
    """Stream one safetensors file: header from the plan, then each tensor as it is generated."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        shape, dtype = plan[key]
        end = offset + _numel(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key in keys:
            shape, dtype = plan[key]
            t = make(key).to(dtype).reshape(shape).contiguous().cpu()
            f.write(t.view(torch.uint8).numpy().data)  # no extra host copy of a 1.2 GB embedding
    return offset


def write_weights(out: Path, cfg: ModelConfig, plan: Plan, seed: int, device: str, shard_bytes: int) -> None:
    shards = plan_shards(plan, shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for i, (name, keys) in enumerate(zip(names, shards, strict=True)):
        t0 = time.perf_counter()
        nbytes = write_safetensors(out / name, keys, plan,
                                   lambda k: make_tensor(k, plan[k][0], cfg, seed, device))
        total += nbytes
        weight_map.update(dict.fromkeys(keys, name))
        dt = time.perf_counter() - t0
        print(f"[ckpt] shard {i + 1}/{len(shards)} {name}: {len(keys)} tensors, {nbytes / _GB:.2f} GB "
              f"in {dt:.1f} s ({nbytes / _GB / max(dt, 1e-9):.2f} GB/s)", flush=True)
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_token2wav(asset_dir: Path, seed: int, full: bool) -> None:
    from engine.token2wav.assets import build_tiny_modules, hift_file_state, write_tiny_token2wav_assets
    from engine.token2wav.config import FlowConfig, HiFTConfig, flow_yaml_text

    write_prompt_models(asset_dir, seed)
    if not full:
        write_tiny_token2wav_assets(asset_dir, seed)
        return
    asset_dir.mkdir(parents=True, exist_ok=True)
    flow, hift = build_tiny_modules(seed, FlowConfig(), HiFTConfig())  # full-size defaults (§1.6, §1.7)
    (asset_dir / "flow.yaml").write_text(flow_yaml_text(FlowConfig()))
    torch.save({k: v.contiguous() for k, v in flow.state_dict().items()}, asset_dir / "flow.pt")
    torch.save(hift_file_state(hift), asset_dir / "hift.pt")


def write_prompt_models(asset_dir: Path, seed: int) -> None:
    """The tiny voice-prompt ONNX stand-ins (tiny_prompt_models.py; the real ones are not reproducible at size):
    `ref_audio` sessions then build clip voices at the full flow size. Skipped where `onnx` is not installed
    (the GPU host's offline bundle): those sessions keep the named voice."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        print("[ckpt] onnx is not installed: no voice-prompt ONNX models (ref_audio keeps the named voice)", flush=True)
        return
    from tiny_prompt_models import write_tiny_prompt_models

    write_tiny_prompt_models(asset_dir, seed)


def build_checkpoint(out: Path, *, size: str = "full", seed: int = 0, device: str = "cpu", vision: bool = True,
                     shard_bytes: int = SHARD_BYTES) -> Path:
    full = size == "full"
    config = full_config() if full else copy.deepcopy(TINY_CONFIG)
    config["init_vision"] = vision
    if not vision:
        config.pop("vision_config")
    files = filler_tokenizer_files(REAL_REGULAR_TOKENS) if full else tokenizer_files()
    ids = files["added_tokens.json"]
    config["bos_token_id"], config["eos_token_id"] = ids["<|endoftext|>"], ids["<|im_end|>"]
    cfg = ModelConfig.from_dict(config)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _write_json(out / "preprocessor_config.json", preprocessor_config())
    _write_json(out / "generation_config.json", generation_config(ids))
    for name, content in files.items():
        if isinstance(content, str):
            (out / name).write_text(content, encoding="utf-8")
        else:
            _write_json(out / name, content)
    dtype = torch.bfloat16 if full else torch.float32
    write_weights(out, cfg, checkpoint_plan(cfg, dtype), seed, device, shard_bytes)
    write_token2wav(out / "assets" / "token2wav", seed, full)
    print(f"[ckpt] token2wav assets written ({time.perf_counter() - t0:.1f} s so far)", flush=True)
    voice = (make_random_voice(VOICE_SEED, codebook=cfg.tts.eos_code, num_tokens=VOICE_TOKENS,
                               ref_seconds=VOICE_SECONDS) if full
             else make_random_voice(VOICE_SEED, codebook=cfg.tts.eos_code))
    voice.save(out / "voices" / "default.safetensors")
    _write_json(out / "config.json", config)  # last: an existing config.json means "complete"
    return out


def print_meta(size: str, vision: bool, shard_bytes: int) -> None:
    config = full_config() if size == "full" else copy.deepcopy(TINY_CONFIG)
    cfg = ModelConfig.from_dict(config, with_vision=vision)
    plan = checkpoint_plan(cfg, torch.bfloat16 if size == "full" else torch.float32)
    shards = plan_shards(plan, shard_bytes)
    for i, keys in enumerate(shards):
        for key in keys:
            shape, dtype = plan[key]
            print(json.dumps({"key": key, "shape": list(shape), "dtype": DTYPE_NAMES[dtype], "shard": i + 1}))
    total = sum(_numel(s) * d.itemsize for s, d in plan.values())
    print(f"# {len(plan)} tensors, {total / _GB:.2f} GB in {len(shards)} shards", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--size", choices=("full", "tiny"), default="full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where tensors are generated (cuda is much faster)")
    ap.add_argument("--vision", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--shard-gb", type=float, default=SHARD_BYTES / _GB)
    ap.add_argument("--meta", action="store_true", help="print the key plan as JSON lines; write nothing")
    args = ap.parse_args(argv)
    shard_bytes = int(args.shard_gb * _GB)
    if args.meta:
        print_meta(args.size, args.vision, shard_bytes)
        return 0
    if args.out is None:
        ap.error("--out is required unless --meta")
    t0 = time.perf_counter()
    build_checkpoint(args.out, size=args.size, seed=args.seed, device=args.device, vision=args.vision,
                     shard_bytes=shard_bytes)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"[ckpt] wrote {args.out} ({size / _GB:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
