"""bench/token2wav_invariance_ops.py on the tiny Token2Wav (CPU, fp32): every part and layer is compared at every
count, and session 0's output among n differs from its output alone by float32 rounding at most.

NOTE: not bit for bit on the CPU: oneDNN's convs give batch 1 other bits than batch 2, and MKL's GEMMs change
with the row count (the HiFT f0 classifier, C -> 1, already at 2 rows; the DiT t_embedder at 16), so a CPU run
cannot tell an unequal part from a harness that feeds row 0 wrongly; the bound below can (a wrong row 0 is O(1)).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench import token2wav_invariance_ops

PARTS = ("flow encoder (encode_ragged): mu + caches", "DiT estimator, one call (forward_ragged)",
         "flow solve, 5 Euler steps (solve_ragged)", "HiFT f0 predictor", "HiFT NSF source (fixed rand_ini, noise)",
         "HiFT decode (mel + source -> wav)", "HiFT forward (mel -> wav)", "DiT block 0 SDPA (key mask)")


def test_token2wav_invariance_ops_tiny(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    token2wav_invariance_ops.main(["--tiny", "--counts", "2,3", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["part"]: r["cells"] for r in result["rows"]}
    assert result["device"] == "cpu" and result["flow_dtype"] == "torch.float32" and result["counts"] == [2, 3]
    assert len(rows) == len(result["rows"]) == 42        # no part named twice
    assert set(PARTS) <= set(rows)
    prefixes = {"encoder ": 8, "DiT block 0 ": 12, "DiT t_embedder ": 2, "HiFT stage 0 ": 9}
    assert {k: sum(p.startswith(k) for p in rows) for k in prefixes} == prefixes
    assert all(set(cells) == {"2", "3"} for cells in rows.values())
    assert all(c == "=" or float(c) < 1e-5 for cells in rows.values() for c in cells.values())


def test_compare_flags_a_row_that_reads_other_rows() -> None:
    x = torch.arange(8.0)
    rowwise = token2wav_invariance_ops.compare("row-wise", lambda n: (x[:n] * 2)[0], [2, 4])
    assert rowwise["cells"] == {"2": "=", "4": "="}
    coupled = token2wav_invariance_ops.compare("coupled", lambda n: x[:n].sum(), [2, 4])
    assert coupled == dict(part="coupled", cells={"2": "1", "4": "6"})
