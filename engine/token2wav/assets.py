"""Token2Wav asset loading and the tiny-asset writer (model.md §6.10, §8.4, §8.5, §9.2, §9.4).

`flow.pt` / `hift.pt` are read with `torch.load(weights_only=True)`; nothing in the asset directory
is executed. Loading is strict: every missing, unexpected or mis-shaped key is listed in one error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from engine.token2wav.config import TINY_FLOW, FlowConfig, HiFTConfig, flow_yaml_text, load_flow_yaml
from engine.token2wav.flow import Flow
from engine.token2wav.hift import HiFT
from engine.weights import fuse_weight_norm, init_module_, split_weight_norm

log = logging.getLogger(__name__)

HIFT_PREFIX = "generator."
TINY_HIFT = HiFTConfig(base_channels=32, f0_cond_channels=32)
# Convs that the reference wraps in weight_norm (source_downs, l_linear and the classifier are plain).
_WEIGHT_NORMED = re.compile(r"^(conv_pre|conv_post|ups\.\d+|(source_)?resblocks\.\d+\.convs[12]\.\d+"
                            r"|f0_predictor\.condnet\.\d+)$")
Layout = Literal["A", "B"]


class AssetError(ValueError):
    """A Token2Wav asset is missing or does not match the expected keys/shapes."""


@dataclass
class Token2WavModels:
    flow: Flow
    hift: HiFT
    flow_cfg: FlowConfig
    hift_cfg: HiFTConfig
    layout: Layout


def detect_layout(asset_dir: Path) -> Layout:
    """B (minicpmo-utils 1.0.7) when `config.yaml` and `hift_original.pt` are present, else A (§6.10)."""
    return "B" if (asset_dir / "config.yaml").is_file() and (asset_dir / "hift_original.pt").is_file() else "A"


def _load_pt(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise AssetError(f"{path}: file is missing")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise AssetError(f"{path}: expected a flat dict of tensors")
    return dict(state)


def load_strict(module: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Copy `state` into `module`, failing with one error that lists every key problem."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}"
                    for k, v in expected.items() if k in state and state[k].shape != v.shape)
    if missing or unexpected or shapes:
        raise AssetError(f"{what}: missing keys {missing}; unexpected keys {unexpected}; bad shapes {shapes}")
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def infer_hift_config(state: Mapping[str, torch.Tensor]) -> HiFTConfig:
    """base_channels from conv_pre, F0 cond channels from condnet.0 (fused state, prefix stripped)."""
    try:
        return HiFTConfig(base_channels=int(state["conv_pre.weight"].shape[0]),
                          f0_cond_channels=int(state["f0_predictor.condnet.0.weight"].shape[0]))
    except KeyError as exc:
        raise AssetError(f"hift: cannot infer config, key {exc} is missing") from exc


def hift_state_from_file(raw: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip `generator.` and fuse weight norm (either naming) into plain `.weight`."""
    stripped = {k[len(HIFT_PREFIX):] if k.startswith(HIFT_PREFIX) else k: v for k, v in raw.items()}
    try:
        return fuse_weight_norm(stripped)
    except KeyError as exc:
        raise AssetError(f"hift: {exc}") from exc


def load_token2wav(asset_dir: Path, device: torch.device | str, flow_dtype: torch.dtype = torch.float32,
                   noise_seed: int = 0) -> Token2WavModels:
    asset_dir = Path(asset_dir)
    layout = detect_layout(asset_dir)
    hift_file = "hift.pt"
    if layout == "B":
        # NOTE: layout B's hift.pt is a causal CosyVoice3 vocoder; the §6.5 path needs the original HiFT.
        log.warning("%s: layout B detected; loading hift_original.pt into the cross-fade HiFT path", asset_dir)
        hift_file = "hift_original.pt"
    flow_cfg = load_flow_yaml(asset_dir / "flow.yaml")
    flow = Flow(flow_cfg, noise_seed=noise_seed)
    load_strict(flow, _load_pt(asset_dir / "flow.pt"), "flow.pt")
    hift_state = hift_state_from_file(_load_pt(asset_dir / hift_file))
    hift_cfg = infer_hift_config(hift_state)
    hift = HiFT(hift_cfg)
    load_strict(hift, hift_state, hift_file)
    flow = flow.to(device=device, dtype=flow_dtype).eval()
    hift = hift.to(device=device).eval()
    return Token2WavModels(flow, hift, flow_cfg, hift_cfg, layout)


def hift_file_state(hift: HiFT) -> dict[str, torch.Tensor]:
    """hift.pt layout: `generator.` prefix; weight-normed convs as parametrizations original0/1."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hift.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight" and _WEIGHT_NORMED.match(prefix):
            g, v = split_weight_norm(value)
            out[f"{HIFT_PREFIX}{prefix}.parametrizations.weight.original0"] = g.contiguous().clone()
            out[f"{HIFT_PREFIX}{prefix}.parametrizations.weight.original1"] = v.contiguous().clone()
        else:
            out[HIFT_PREFIX + key] = value.contiguous().clone()
    return out


def build_tiny_modules(seed: int, flow_cfg: FlowConfig = TINY_FLOW, hift_cfg: HiFTConfig = TINY_HIFT
                       ) -> tuple[Flow, HiFT]:
    """Flow then HiFT initialised from one seeded generator (§9.4 recipe)."""
    gen = torch.Generator().manual_seed(seed)
    flow, hift = Flow(flow_cfg), HiFT(hift_cfg)
    init_module_(flow, gen)
    init_module_(hift, gen)
    return flow, hift


def write_tiny_token2wav_assets(asset_dir: Path, seed: int) -> None:
    """flow.yaml, flow.pt and hift.pt at the §9.2 tiny dims; byte-identical for the same seed."""
    asset_dir = Path(asset_dir)
    asset_dir.mkdir(parents=True, exist_ok=True)
    flow, hift = build_tiny_modules(seed)
    (asset_dir / "flow.yaml").write_text(flow_yaml_text(TINY_FLOW))
    torch.save({k: v.contiguous().clone() for k, v in flow.state_dict().items()}, asset_dir / "flow.pt")
    torch.save(hift_file_state(hift), asset_dir / "hift.pt")
