"""bench/batch_invariance_ops.py on the tiny model: every op row and forward row is compared at the engine's row
counts, and the GEMMs padded to the top count read the same bits at every count (what the H200 run showed for
padding at full size)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import batch_invariance_ops


def test_batch_invariance_ops_tiny(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    batch_invariance_ops.main(["--tiny", "--no-compile", "--pads", "8", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["op"]: r["cells"] for r in result["rows"]}
    assert result["min_rows"] == 32 and result["context"] == 128
    assert all(set(cells) == {"4", "8"} for op, cells in rows.items() if "prefill" not in op)  # vs 2 rows
    padded = [op for op in rows if "(rows >= " in op]
    assert len(padded) == 8  # four GEMMs at 8 and at 32 rows
    assert all(cells == {"4": "=", "8": "="} for op, cells in rows.items() if op in padded)
    assert "decode forward [matmul] eager" in rows and "unit prefill forward eager" in rows
    assert not any("compiled" in op for op in rows)
