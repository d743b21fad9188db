"""The stub's embedded interpreter starts in the C locale (no locale coercion, PYTHONUTF8 not read), where
`open()` without an encoding reads ASCII: torch.compile's inductor then failed to read its UTF-8 templates and
every compiled engine option failed the model's load (`workarounds.utf8_text_files`). A Python started the same
way (C locale, no coercion, no UTF-8 mode) stands in for the stub here; the served path is
tests/e2e/test_first_codes.py, whose profile compiles the TTS step and Token2Wav's blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from make_model_repository import REPO_ROOT

READ_UTF8 = """
import sys
from pathlib import Path
path = Path(sys.argv[1])
if sys.argv[2] == "fix":
    from model_repository.common.workarounds import utf8_text_files
    print(utf8_text_files())
with open(path) as f:
    print(f.read() == "\\u03c9 \\u2192 \\u221e")
"""  # escapes: the command line itself is read in the C locale


def _run_in_c_locale(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    text = tmp_path / "template.py.jinja"
    text.write_text("ω → ∞", encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", READ_UTF8, str(text), mode], env=env, capture_output=True,
                          text=True, encoding="utf-8", timeout=60, check=False)


def test_the_c_locale_reads_utf8_text_as_ascii(tmp_path: Path) -> None:
    """The defect, shown without the stub: what inductor's load_template met."""
    run = _run_in_c_locale(tmp_path, "plain")
    assert run.returncode != 0 and "UnicodeDecodeError" in run.stderr and "ascii" in run.stderr, run


def test_utf8_text_files_makes_open_read_utf8(tmp_path: Path) -> None:
    run = _run_in_c_locale(tmp_path, "fix")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["UTF-8", "True"]
