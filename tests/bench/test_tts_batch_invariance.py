"""bench/tts_batch_invariance.py on the tiny TTS: the watched session's codes alone and among others are compared
at every count, and on the CPU they are equal (the GPU run asks the same at full size)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tts_batch_invariance


def test_tts_batch_invariance_tiny(tmp_path: Path) -> None:
    out = tmp_path / "tts.json"
    tts_batch_invariance.main(["--tiny", "--counts", "2,4", "--rows", "5", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["codes"] == 25 and result["graphs"] is False
    assert [(r["sessions"], r["equal_alone"], r["first_difference"]) for r in result["results"]] == [
        (2, True, None), (4, True, None)]
