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
    bench_mixed_step.main(["--tiny", "--dtype", "bfloat16", "--mixes", "1:3,4:6", "--min-rows", "32",
                           "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["min_rows"] == 32
    mixes = [r for r in result["rows"] if "units" in r]
    assert [(r["what"], r["units"], r["tokens"]) for r in mixes] == [
        ("decode only", 0, 3), ("prefill only", 1, 0), ("mixed split", 1, 3), ("mixed merge", 1, 3),
        ("mixed shared", 1, 3), ("decode only", 0, 6), ("prefill only", 4, 0), ("mixed split", 4, 6),
        ("mixed shared", 4, 6)]  # 10 rows do not fit the prefill graph: no merge
    assert all(r["median_ms"] > 0 for r in result["rows"])
    assert all(r["tokens_equal_split"] and r["max_abs_diff"] == 0 for r in mixes if r["what"].startswith("mixed")
               and r["what"] != "mixed merge")
    # split's own invariance: the watched row alone and among others (16 slots: decode buckets up to 16)
    alone = [(r["what"], r["rows"]) for r in result["rows"] if "equal_alone" in r]
    assert alone == [("decode alone vs among", n) for n in (1, 4, 8, 16)] + [
        ("logits alone vs among", n) for n in (2, 4, 8, 16)] + [("prefill alone vs among", n) for n in (4, 8)]
    assert all(r["equal_alone"] and r["max_abs_diff"] == 0 for r in result["rows"] if "equal_alone" in r)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_bench_mixed_step_invariance_only(tmp_path: Path) -> None:
    """`--mixes ''` times only the invariance rows (no shared graph set is built); --slots widens the buckets."""
    out = tmp_path / "inv.json"
    bench_mixed_step.main(["--tiny", "--mixes", "", "--slots", "32", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows if r["what"] == "decode alone vs among"] == [1, 4, 8, 16, 32]
    assert all("equal_alone" in r for r in rows)
