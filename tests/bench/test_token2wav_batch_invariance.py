"""bench/token2wav_batch_invariance.py on the tiny Token2Wav: the watched session's turn (model.md §6.6's worked
example: 25, 25 and 12 codes -> 66,240 samples) alone and among others is compared, and on the CPU it is equal."""

from __future__ import annotations

import json
from pathlib import Path

from bench import token2wav_batch_invariance


def test_token2wav_batch_invariance_tiny(tmp_path: Path) -> None:
    out = tmp_path / "t2w.json"
    token2wav_batch_invariance.main(["--tiny", "--counts", "3", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["samples"] == 66240 and result["misses"] == {}
    assert result["results"] == [dict(sessions=3, equal_alone=True, samples=66240, max_abs_diff_lsb=0)]
