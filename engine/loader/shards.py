"""Sharded safetensors reading and the strict key check (model.md §8.5).

`ShardIndex` maps every key to its file (from `model.safetensors.index.json`, else every
`*.safetensors` of the directory) and knows shapes and dtypes without reading data. `check_keys`
compares that against the expected key list and raises ONE `CheckpointError` listing every missing,
unexpected and wrong-shape key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ConfigError, ModelConfig
from engine.model.keys import HeadCodeFormat, Shapes, expected_keys, is_dropped_key, optional_keys

INDEX_FILE = "model.safetensors.index.json"
# How many names each section of an error message lists before summarising.
MAX_LISTED = 50


class CheckpointError(ConfigError):
    """The checkpoint's tensors do not match the config. The message lists the bad keys (capped at
    MAX_LISTED per kind); the full lists are kept on the exception."""

    def __init__(self, message: str, *, missing: list[str] | None = None,
                 unexpected: list[str] | None = None, wrong_shape: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.wrong_shape = wrong_shape or []


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


class ShardIndex:
    """key -> (file, shape, dtype) for a checkpoint directory; each key must appear exactly once."""

    def __init__(self, entries: Mapping[str, TensorInfo]) -> None:
        self.entries = dict(entries)

    @classmethod
    def from_dir(cls, path: Path) -> ShardIndex:
        index = path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: weight_map is missing or empty")
            files = sorted({path / f for f in weight_map.values()})
        else:
            weight_map = None
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files found")
        entries: dict[str, TensorInfo] = {}
        dupes: list[str] = []
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index}: shard {file.name} does not exist")
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in entries:
                        dupes.append(f"{key} ({entries[key].file.name}, {file.name})")
                        continue
                    sl = f.get_slice(key)
                    entries[key] = TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
        if dupes:
            raise CheckpointError(f"{path}: keys stored more than once: {_cap(dupes)}")
        if weight_map is not None:
            wrong = sorted(k for k, f in weight_map.items()
                           if k not in entries or entries[k].file.name != f)
            extra = sorted(set(entries) - set(weight_map))
            if wrong or extra:
                raise CheckpointError(f"{index}: disagrees with the shards: not where the index says "
                                      f"{_cap(wrong)}; not in the index {_cap(extra)}")
        return cls(entries)

    def keys(self) -> set[str]:
        return set(self.entries)

    def nbytes(self, keys: Iterable[str]) -> int:
        total = 0
        for k in keys:
            info = self.entries[k]
            numel = 1
            for d in info.shape:
                numel *= d
            total += numel * _DTYPE_BYTES.get(info.dtype, 4)
        return total

    def read(self, keys: Iterable[str], device: str = "cpu") -> dict[str, torch.Tensor]:
        """Load `keys`, opening each shard once."""
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.entries[k].file, []).append(k)
        out: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device=device) as f:
                for k in names:
                    out[k] = f.get_tensor(k)
        return out


_DTYPE_BYTES = {"F64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I64": 8, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1}


def head_code_format(keys: set[str]) -> HeadCodeFormat:
    """Which weight-norm naming the file uses for `tts.head_code.0` (model.md §8.5 a/b/c)."""
    if "tts.head_code.0.weight" in keys:
        return "fused"
    if "tts.head_code.0.weight_g" in keys or "tts.head_code.0.weight_v" in keys:
        return "weight_g"
    return "parametrizations"


def check_keys(cfg: ModelConfig, index: ShardIndex) -> tuple[set[str], set[str]]:
    """Strict check of the file against the config. Returns (keys to load, optional keys to drop)."""
    present = index.keys()
    expected = expected_keys(cfg, head_code_format(present))
    optional = optional_keys(cfg)
    missing = sorted(set(expected) - present)
    unexpected = sorted(k for k in present - set(expected) - set(optional)
                        if not is_dropped_key(k, cfg))
    shapes: Shapes = {**optional, **expected}
    wrong = sorted(f"{k} {list(index.entries[k].shape)} != {list(shapes[k])}"
                   for k in present & set(shapes) if index.entries[k].shape != shapes[k])
    if missing or unexpected or wrong:
        parts = [f"{name} ({len(keys)}): {_cap(keys)}"
                 for name, keys in (("missing", missing), ("unexpected", unexpected),
                                    ("wrong shape", wrong)) if keys]
        raise CheckpointError("checkpoint does not match config.json; " + "; ".join(parts),
                              missing=missing, unexpected=unexpected, wrong_shape=wrong)
    return set(expected), present - set(expected)


def _cap(items: list[str]) -> str:
    if len(items) <= MAX_LISTED:
        return ", ".join(items) if items else "-"
    return ", ".join(items[:MAX_LISTED]) + f", ... ({len(items) - MAX_LISTED} more)"
