"""bench/token2wav_batch_invariance.py on the tiny Token2Wav: the watched session's turn (model.md §6.6's worked
example: 25, 25 and 12 codes -> 66,240 samples) alone and among others is compared, and on the CPU it is equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import token2wav_batch_invariance


@pytest.mark.parametrize("last", [False, True])
def test_token2wav_batch_invariance_tiny(tmp_path: Path, last: bool) -> None:
    out = tmp_path / "t2w.json"
    token2wav_batch_invariance.main(["--tiny", "--counts", "3", "--json", str(out)] + ["--watched-last"] * last)
    result = json.loads(out.read_text())
    assert result["samples"] == 66240 and result["misses"] == {} and result["watched_last"] is last
    alone, among = result["results"]
    assert alone["sessions"] == 1 and alone["step_ms"] > 0
    assert {k: among[k] for k in ("sessions", "equal_alone", "samples", "max_abs_diff_lsb")} == dict(
        sessions=3, equal_alone=True, samples=66240, max_abs_diff_lsb=0)
    # the flow encoder's output, its mel and the HiFT's float speech per call: '=' or a max |diff| (oneDNN's float32 rounding on the
    # CPU may differ below one LSB of PCM); a first differing call only when one of them differs
    assert among["step_ms"] > 0 and all(isinstance(among[k], str) for k in ("mu", "mel", "speech"))
    assert (among["first_call"] is None) == (among["mu"] == among["mel"] == among["speech"] == "=")
