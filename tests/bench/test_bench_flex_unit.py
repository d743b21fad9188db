"""bench/bench_flex_unit.py: configuration names become the flex call's kernel options, beside the engine's split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.bench_flex_unit import kernel_options  # noqa: E402


def test_configuration_names_map_to_kernel_options() -> None:
    assert kernel_options("default", 4) == {"SPLIT_KV": 4} and kernel_options("default", None) == {}
    assert kernel_options("w4s2", 4) == {"SPLIT_KV": 4, "num_warps": 4, "num_stages": 2}
    assert kernel_options("n32w4s2", None) == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert kernel_options("s3", 2) == {"SPLIT_KV": 2, "num_stages": 3}
    for bad in ("", "x", "w4n32", "4"):
        with pytest.raises(ValueError, match="bad configuration"):
            kernel_options(bad, 4)
