"""`load_checkpoint`: a MiniCPM-o 4.5 checkpoint directory -> ready modules (model.md §8).

Real mode reads sharded safetensors strictly (shards.py), fuses weight norm in fp32 and casts every
thinker/TTS weight to `dtype`; Token2Wav stays fp32. Dummy mode builds the same full-size modules from
config.json alone, directly on the target device, with the seeded §9.4 recipe (benchmarks, §9.5).
`components` names the checkpoint prefixes a process keeps (a stage process: stage0 the thinker's, TTS
`tts`, Token2Wav none): the others are dropped from the meta skeleton before anything is read, so their
tensors are never read from the shards nor materialised on any device. The key check still covers the
whole file (it reads only the shard headers).
Progress is logged at INFO per component with time and bytes; each record's `extra` carries
`component`, `bytes` (parameter bytes) and `device_bytes` (the CUDA allocator's growth while the
component was materialised; None off CUDA), so a benchmark can read memory per component off the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.loader.shards import CheckpointError, ShardIndex, check_keys
from engine.model.minicpmo import MiniCPMO, build_skeleton, init_weights_, materialize_
from engine.tokenizer import SpecialTokens, Tokenizer, load_tokenizer
from engine.voice import VoicePack, list_voices, load_voice
from engine.weights import fuse_weight_norm

log = logging.getLogger(__name__)

TOKEN2WAV_DIR = Path("assets") / "token2wav"
VOICES_DIR = "voices"
_MIB = 1 << 20
# The checkpoint prefixes each stage process keeps (MiniCPMO.components() names).
THINKER_COMPONENTS = ("llm", "apm", "audio_projection_layer", "vpm", "resampler")
TTS_COMPONENTS = ("tts",)
_WEIGHT_NORM_SUFFIXES = (".parametrizations.weight.original0", ".parametrizations.weight.original1",
                         ".weight_g", ".weight_v")


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    config: ModelConfig
    model: MiniCPMO
    tokenizer: Tokenizer | None  # None only in dummy mode without tokenizer files
    special_tokens: SpecialTokens | None
    token2wav: Any | None  # what engine.token2wav.assets.load_token2wav returns; None if not loaded
    voices_dir: Path
    device: torch.device
    dtype: torch.dtype

    def voices(self) -> dict[str, Path]:
        return list_voices(self.voices_dir)

    def voice(self, voice_id: str) -> VoicePack:
        path = self.voices().get(voice_id)
        if path is None:
            raise CheckpointError(f"{self.voices_dir}: no voice pack {voice_id!r}")
        return load_voice(path, codebook=self.config.tts.eos_code)


def load_checkpoint(path: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.bfloat16, with_vision: bool = True,
                    dummy: bool = False, seed: int = 0, with_token2wav: bool = True,
                    flow_dtype: torch.dtype = torch.float32,
                    components: Collection[str] | None = None) -> LoadedCheckpoint:
    """Load (or, with `dummy`, randomly build) the checkpoint at `path`; only `components` if given."""
    path, device = Path(path), torch.device(device)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_file(path / "config.json", with_vision=with_vision)
    tok, special = _tokenizer(path, cfg, required=not dummy)
    model = build_skeleton(cfg)
    _keep_only(model, components)
    if dummy:
        _init_dummy(model, device, dtype, seed)
    else:
        _load_weights(model, path, device, dtype)
    for module in model.components().values():  # built on meta: RoPE tables are recomputed, never loaded
        if hasattr(module, "reset_rope_"):
            module.reset_rope_()
    model.eval()
    t2w = None
    if with_token2wav:
        t2w = _token2wav(path, device, flow_dtype, dummy=dummy, seed=seed)
    _validate(cfg, model, t2w)
    seconds = time.perf_counter() - t0
    log.info("checkpoint %s loaded (dummy=%s, %s, %s) in %.2f s", path, dummy, device, dtype, seconds,
             extra={"dummy": dummy, "device": str(device), "dtype": str(dtype), "seconds": seconds})
    return LoadedCheckpoint(path=path, config=cfg, model=model, tokenizer=tok, special_tokens=special,
                            token2wav=t2w, voices_dir=path / VOICES_DIR, device=device, dtype=dtype)


def _keep_only(model: MiniCPMO, components: Collection[str] | None) -> None:
    """Drop every component not in `components` from the (meta) skeleton: nothing of it is read or built."""
    if components is None:
        return
    unknown = sorted(set(components) - set(THINKER_COMPONENTS) - set(TTS_COMPONENTS))
    if unknown:
        raise ValueError(f"unknown checkpoint components {unknown}")
    for name in list(model.components()):
        if name not in components:
            setattr(model, name, None)


def _tokenizer(path: Path, cfg: ModelConfig, *, required: bool
               ) -> tuple[Tokenizer | None, SpecialTokens | None]:
    has_files = (path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()
    if not has_files and not required:
        log.warning("no tokenizer files in %s; dummy load continues without a tokenizer", path)
        return None, None
    return load_tokenizer(path, cfg)


def _load_weights(model: MiniCPMO, path: Path, device: torch.device, dtype: torch.dtype) -> None:
    index = ShardIndex.from_dir(path)
    wanted, dropped = check_keys(model.cfg, index)
    if dropped:
        log.debug("dropping optional keys: %s", sorted(dropped))
    for prefix, module in model.components().items():
        t0 = time.perf_counter()
        before = _device_allocated(device)
        keys = sorted(k for k in wanted if k.startswith(prefix + "."))
        # Plain tensors go straight to the target device (no host copy of a large component on GPU
        # loads); weight-norm pairs are fused on the CPU in fp32 so W is the same on every device.
        norm_keys = [k for k in keys if k.endswith(_WEIGHT_NORM_SUFFIXES)]
        raw = index.read([k for k in keys if k not in norm_keys], device=str(device))
        raw |= fuse_weight_norm(index.read(norm_keys))
        state = {k[len(prefix) + 1:]: v for k, v in raw.items()}
        _strict_match(prefix, module, state)
        materialize_(module, state, device=device, dtype=dtype)
        del raw, state  # file tensors that were cast (not adopted) are freed before measuring
        grown = _device_growth(device, before)
        nbytes = index.nbytes(keys)
        log.info("loaded %s: %d tensors, %.1f MiB in %.2f s", prefix, len(keys), nbytes / _MIB,
                 time.perf_counter() - t0,
                 extra={"component": prefix, "tensors": len(keys), "bytes": nbytes, "device_bytes": grown})


def _strict_match(prefix: str, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The module must hold exactly the (fused) checkpoint tensors; a mismatch is a module/spec bug."""
    own = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(f"{prefix}.{k}" for k in set(own) - set(got))
    unexpected = sorted(f"{prefix}.{k}" for k in set(got) - set(own))
    wrong = sorted(f"{prefix}.{k} {list(got[k])} != {list(own[k])}"
                   for k in set(own) & set(got) if own[k] != got[k])
    if missing or unexpected or wrong:
        raise CheckpointError(f"module {prefix} does not match the checkpoint: missing {missing}; "
                              f"unexpected {unexpected}; wrong shape {wrong}",
                              missing=missing, unexpected=unexpected, wrong_shape=wrong)


def _init_dummy(model: MiniCPMO, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    t0 = time.perf_counter()
    for prefix, module in model.components().items():  # one component at a time: memory per component
        before = _device_allocated(device)
        materialize_(module, None, device=device, dtype=dtype)
        _log_part(prefix, module, _device_growth(device, before))
    generator = torch.Generator(device=device).manual_seed(seed)
    init_weights_(model, generator)
    log.info("dummy weights initialised in %.2f s (seed %d)", time.perf_counter() - t0, seed)


def _device_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _device_growth(device: torch.device, before: int | None) -> int | None:
    """Bytes the CUDA caching allocator hands out now minus `before` (None off CUDA)."""
    now = _device_allocated(device)
    return None if now is None or before is None else now - before


def _token2wav(path: Path, device: torch.device, flow_dtype: torch.dtype, *, dummy: bool,
               seed: int) -> Any:
    asset_dir = path / TOKEN2WAV_DIR
    if not asset_dir.is_dir():
        if not dummy:
            raise CheckpointError(f"{asset_dir}: Token2Wav assets not found")
        return _dummy_token2wav(device, flow_dtype, seed)
    from engine.token2wav.assets import load_token2wav  # lazy: Token2Wav is optional for text tests

    t0 = time.perf_counter()
    before = _device_allocated(device)
    t2w = load_token2wav(asset_dir, device, flow_dtype)
    log.info("loaded token2wav in %.2f s", time.perf_counter() - t0,
             extra={"component": "token2wav", "bytes": _module_bytes(t2w.flow, t2w.hift),
                    "device_bytes": _device_growth(device, before)})
    return t2w


def _dummy_token2wav(device: torch.device, flow_dtype: torch.dtype, seed: int) -> Any:
    """Full-size flow + HiFT (the §1.6/§1.7 defaults) with seeded random weights, for benchmarks."""
    from engine.token2wav.assets import Token2WavModels, build_tiny_modules
    from engine.token2wav.config import FlowConfig, HiFTConfig

    t0 = time.perf_counter()
    flow_cfg, hift_cfg = FlowConfig(), HiFTConfig()
    flow, hift = build_tiny_modules(seed, flow_cfg, hift_cfg)
    before = _device_allocated(device)
    flow = flow.to(device=device, dtype=flow_dtype).eval()
    _log_part("token2wav.flow", flow, _device_growth(device, before))
    before = _device_allocated(device)
    hift = hift.to(device).eval()
    _log_part("token2wav.hift", hift, _device_growth(device, before))
    t2w = Token2WavModels(flow, hift, flow_cfg, hift_cfg, "A")
    log.info("dummy token2wav (full size) built in %.2f s", time.perf_counter() - t0)
    return t2w


def _module_bytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _log_part(component: str, module: torch.nn.Module, device_bytes: int | None) -> None:
    nbytes = _module_bytes(module)
    log.info("dummy %s: %.1f MiB", component, nbytes / _MIB,
             extra={"component": component, "bytes": nbytes, "device_bytes": device_bytes})


def flow_vocab_size(t2w: Any) -> int | None:
    """The flow token vocabulary of the loaded Token2Wav models (None if it exposes none)."""
    flow_cfg = getattr(t2w, "flow_cfg", None)
    vocab = getattr(flow_cfg, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _validate(cfg: ModelConfig, model: MiniCPMO, t2w: Any | None) -> None:
    """Post-load checks of §8.5 that the key check does not already imply."""
    emb_rows = model.tts.emb_text.weight.shape[0] if model.tts is not None else cfg.llm.vocab_size
    if emb_rows < cfg.llm.vocab_size:
        raise CheckpointError(f"tts.emb_text has {emb_rows} rows < vocab_size {cfg.llm.vocab_size}")
    if t2w is not None:
        vocab = flow_vocab_size(t2w)
        if vocab is not None and vocab != cfg.tts.eos_code:
            raise CheckpointError(f"config.tts_config.num_audio_tokens: num_audio_tokens - 1 = "
                                  f"{cfg.tts.eos_code} must equal the flow vocab_size {vocab}")
