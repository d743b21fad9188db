"""Weight-norm fusion/splitting and the seeded random-init recipe (model.md §8.5, §9.4).

Shared by the loader, the tiny-checkpoint builder and the full-size dummy mode, so that every
module gets the same, reproducible weights from the same seed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

INIT_STD = 0.02
_G_SUFFIXES = (".parametrizations.weight.original0", ".weight_g")
_V_SUFFIXES = (".parametrizations.weight.original1", ".weight_v")


def _norm_except_dim0(v: torch.Tensor) -> torch.Tensor:
    # [out, ...] -> [out, 1, ...]: L2 norm over every dim except 0.
    return v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))


def fuse_weight_norm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every (g, v) pair, in either naming, by the fused `<prefix>.weight` = g * v / ||v||.

    Fusion runs in fp32 and casts back to v's dtype. Already fused weights pass through unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        for kind, suffixes in (("g", _G_SUFFIXES), ("v", _V_SUFFIXES)):
            hit = next((s for s in suffixes if key.endswith(s)), None)
            if hit is not None:
                pairs.setdefault(key[: -len(hit)], {})[kind] = value
                break
        else:
            out[key] = value
    for prefix, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            missing = "g" if "g" not in gv else "v"
            raise KeyError(f"{prefix}: weight-norm pair is missing its {missing} tensor")
        g, v = gv["g"].float(), gv["v"].float()
        out[prefix + ".weight"] = (g * v / _norm_except_dim0(v)).to(gv["v"].dtype)
    return out


def split_weight_norm(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, v) with v = weight and g = ||weight|| over every dim except 0, so fusion gives back `weight`."""
    return _norm_except_dim0(weight.float()).to(weight.dtype), weight.clone()


_ONE_INIT = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)


def init_module_(module: nn.Module, generator: torch.Generator,
                 std_overrides: Mapping[str, float] | None = None) -> None:
    """Seeded init of every parameter and persistent buffer, in sorted key order (model.md §9.4).

    Biases 0; norm weights (LayerNorm, RMSNorm-like 1-D `weight` of a module whose class name ends
    in "Norm") and Snake `alpha` 1; everything else N(0, INIT_STD) unless `std_overrides[name]` says
    otherwise. Same seed, same module structure -> identical tensors.
    """
    overrides = dict(std_overrides or {})
    owners = {name: mod for name, mod in module.named_modules()}
    tensors = dict(module.named_parameters())
    tensors.update({k: v for k, v in module.state_dict().items() if k not in tensors})
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if not t.is_floating_point():
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = owners.get(owner_name)
            is_norm = isinstance(owner, _ONE_INIT) or type(owner).__name__.endswith("Norm")
            if leaf == "bias":
                t.zero_()
            elif (leaf == "weight" and is_norm) or leaf == "alpha":
                t.fill_(1.0)
            else:
                std = overrides.get(name, INIT_STD)
                noise = torch.randn(t.shape, generator=generator, device=generator.device,
                                    dtype=torch.float32)
                t.copy_(noise.mul_(std))
