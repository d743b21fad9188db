"""bench/kv_growth.py (P11): a session streamed past its window keeps its Stage0 KV inside the window. A small
window makes the short run evict many times; the bench's own I12 check runs at every unit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_kv_stays_inside_a_small_window_over_many_evictions(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "kv_growth.py"), "--units", "90", "--every", "30",
                    "--kv-window", "300", "--json", str(out)], check=True, cwd=REPO, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["unit"] for r in rows] == [30, 60, 90]
    assert result["window_high"] == 300 and result["window_low"] == 225
    assert all(r["kv_peak"] <= result["window_high"] for r in rows)
    assert rows[-1]["evicted_units"] > rows[0]["evicted_units"] > 0  # it kept evicting
    assert rows[-1]["audio_kv_resets"] >= 2  # and the audio encoder's KV kept resetting (model.md §2.4)
