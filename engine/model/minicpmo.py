"""The MiniCPM-o 4.5 container: one attribute per checkpoint prefix (model.md §1.1, §8.3).

`MiniCPMO(cfg).state_dict()` has exactly the checkpoint's key names once weight norm is fused and the
optional keys (§8.5) are dropped, so the loader can load it strictly. It holds weights only; the
streaming engines own all per-session state and call the components directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from engine.config import ModelConfig

# Resampler `proj` is drawn with std hidden^-0.5 rather than INIT_STD (model.md §9.4).
RESAMPLER_PROJ_KEY = "resampler.proj"


class MiniCPMO(nn.Module):
    """Weights of the Stage0 thinker (llm, apm, projector, optional vision) and the Stage1 TTS."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Imported here so that `engine.model` stays importable while components are optional.
        from engine.model.audio import AudioProjector, WhisperEncoder
        from engine.model.llm import Qwen3LLM
        from engine.model.tts import TTSModel

        self.cfg = cfg
        self.llm = Qwen3LLM(cfg.llm)
        self.apm = WhisperEncoder(cfg.audio)
        self.audio_projection_layer = AudioProjector(in_dim=cfg.audio.d_model,
                                                     out_dim=cfg.llm.hidden_size)
        self.vpm: nn.Module | None = None
        self.resampler: nn.Module | None = None
        if cfg.vision is not None:
            from engine.model.vision import Resampler, SiglipVisionTower

            self.vpm = SiglipVisionTower(cfg.vision)
            self.resampler = Resampler(cfg.vision, embed_dim=cfg.llm.hidden_size)
        self.tts = TTSModel(cfg.tts)

    def reset_rope_(self) -> None:
        """Recompute the LLM's and the TTS's RoPE tables in fp32 on their weights' device.

        NOTE: call after materialising a meta/dummy build: `inv_freq` is a non-persistent buffer that no
        checkpoint or init recipe fills, so nothing else guarantees it is real, on device and fp32.
        """
        self.llm.reset_rope_()
        self.tts.reset_rope_()

    def components(self) -> dict[str, nn.Module]:
        """Checkpoint prefix (without the dot) -> module, in load order; vision absent when disabled."""
        names = ("llm", "apm", "audio_projection_layer", "vpm", "resampler", "tts")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def init_std_overrides(cfg: ModelConfig) -> dict[str, float]:
    """Per-key stds of the §9.4 recipe that differ from INIT_STD (container-level names)."""
    if cfg.vision is None:
        return {}
    return {RESAMPLER_PROJ_KEY: cfg.llm.hidden_size ** -0.5}


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Register every new parameter on the meta device while buffers are built for real.

    Non-persistent buffers (RoPE `inv_freq`, the resampler position table) are computed in the
    modules' constructors and are not in the checkpoint, so they must be real; parameters are
    materialised later by the loader (from the file, or empty + seeded init in dummy mode).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_skeleton(cfg: ModelConfig) -> MiniCPMO:
    """A MiniCPMO whose parameters live on meta and whose buffers are real (CPU)."""
    with params_on_meta():
        return MiniCPMO(cfg)


def materialize_(model: nn.Module, tensors: dict[str, torch.Tensor] | None, *,
                 device: torch.device | str, dtype: torch.dtype) -> None:
    """Give every meta parameter real storage on `device` in `dtype`, filled from `tensors` if given
    (missing names get uninitialised storage), and move all buffers to `device` (keeping their dtype)."""
    for mod_name, mod in model.named_modules():
        for leaf, p in list(mod.named_parameters(recurse=False)):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            src = None if tensors is None else tensors.get(name)
            if src is not None:
                data = src.to(device=device, dtype=dtype)
            else:
                data = torch.empty(p.shape, device=device, dtype=dtype)
            setattr(mod, leaf, nn.Parameter(data, requires_grad=False))
        for leaf, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            src = None if tensors is None else tensors.get(name)
            # A persistent buffer stored in the checkpoint keeps the module's dtype (e.g. fp32 tables).
            mod._buffers[leaf] = (src if src is not None else b).to(device=device, dtype=b.dtype)


def init_weights_(model: MiniCPMO, generator: torch.Generator) -> None:
    """The seeded §9.4 recipe over every component, in `components()` order (same seed -> same weights)."""
    from engine.weights import init_module_

    overrides = init_std_overrides(model.cfg)
    for prefix, module in model.components().items():
        local = {k[len(prefix) + 1:]: v for k, v in overrides.items() if k.startswith(prefix + ".")}
        init_module_(module, generator, local)
