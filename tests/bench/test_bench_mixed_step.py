"""bench/bench_mixed_step.py on the tiny model: the three ways of a mixed step run, and in bf16 the shared pass's
token rows equal split's bit for bit (the figure the GPU run reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_mixed_step


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_bench_mixed_step_tiny(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    bench_mixed_step.main(["--tiny", "--dtype", "bfloat16", "--mixes", "1:3,4:6", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["what"], r["units"], r["tokens"]) for r in rows] == [
        ("mixed split", 1, 3), ("mixed merge", 1, 3), ("mixed shared", 1, 3),
        ("mixed split", 4, 6), ("mixed shared", 4, 6)]  # 10 rows do not fit the prefill graph: no merge
    assert all(r["median_ms"] > 0 for r in rows)
    assert all(r["tokens_equal_split"] and r["max_abs_diff"] == 0 for r in rows if r["what"] != "mixed merge")
