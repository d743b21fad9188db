"""I16 (model.md §4.2, §9.6): no real token id or S3 constant is spelled out in runtime code.

Forbidden literals: the real added-token ids 151643..151747, the silence code 4218 and the codebook
size 6561. They may appear only where a config dataclass names them as a default (allow-list below,
matched by file and exact stripped line so that moving the line keeps it allowed, but editing it not).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("engine", "gateway", "model_repository")
FORBIDDEN_RANGE = range(151643, 151747 + 1)
FORBIDDEN = {4218, 6561}
ALLOWED: set[tuple[str, str]] = {
    ("engine/token2wav/config.py", "vocab_size: int = 6561"),
    ("engine/token2wav/config.py", "silence_code: int = 4218"),
}
_NUMBER = re.compile(r"(?<![\w.])\d[\d_]*(?!\w)(?!\.\d)")
_TEXT_SUFFIXES = {".py", ".pbtxt", ".yaml", ".yml", ".json", ".toml", ".txt", ".cfg", ".ini", ".md", ".js",
                  ".html", ".sh"}


def _is_forbidden(n: int) -> bool:
    return n in FORBIDDEN or n in FORBIDDEN_RANGE


def find_literals(root: Path, folders: tuple[str, ...] = SCANNED,
                  allowed: set[tuple[str, str]] = ALLOWED) -> list[str]:
    hits = []
    for folder in folders:
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if not path.is_file() or path.suffix not in _TEXT_SUFFIXES or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).as_posix()
            for no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if (rel, line.strip()) in allowed:
                    continue
                for m in _NUMBER.finditer(line):
                    if _is_forbidden(int(m.group().replace("_", ""))):
                        hits.append(f"{rel}:{no}: {line.strip()}")
    return hits


def test_no_hardcoded_ids_in_runtime_code() -> None:
    hits = find_literals(REPO)
    assert hits == [], "hard-coded token ids / S3 constants (read them from tokenizer/config):\n" + "\n".join(hits)


def test_scanner_catches_literals(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "bad.py").write_text(
        "LISTEN = 151705\nx = [4218, 1]\ny = 151_747\nok = 4218.5 + 61561 + 15164300\n"
        "silence_code: int = 4218\n")
    allowed = {("engine/bad.py", "silence_code: int = 4218")}
    hits = find_literals(tmp_path, ("engine",), allowed)
    assert [h.split(":")[1] for h in hits] == ["1", "2", "3"]
