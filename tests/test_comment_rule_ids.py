"""A spec rule id in a comment comes with its words (issue 19): `# J-4` alone is only readable with protocol.md
open. A comment or docstring line that cites an id (protocol.md / model.md / targets.md: `J-4`, `RS6`, `B2`,
`§6.3`, ...) must keep at least three words of its own, or sit in a comment block or docstring whose next or
previous line has them. Strings in code (error messages, metric help) are not comments and are not read.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "engine", "model_repository", "serve", "clients")
RULE_ID = re.compile(r"§\s?\d+(\.\d+)*|\b(?:A|AD|B|C|CL|F|H|I|J|K|L|M|O|OA|P|Q|R|RS|SM|T|TK|TR|U|V|X)-?\d{1,2}[a-z]?\b"
                     r"|\bS-\d\b")
FILLER = re.compile(r"\b(protocol\.md|model\.md|targets\.md|see|per|and|the|step|steps|row|rows|rule|rules|of|in|to"
                    r"|for|a|an)\b", re.I)


def _comment_lines(src: str) -> list[tuple[int, str, object]]:
    """(line, text, block) for each comment and docstring line; lines of one comment block or docstring share
    `block`, an inline comment is a block of its own."""
    lines, out, prev = src.splitlines(), [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            alone = not lines[tok.start[0] - 1][:tok.start[1]].strip()
            out.append((tok.start[0], tok.string.lstrip("#"), "block" if alone else ("inline", tok.start[0])))
        elif tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.NL):
            out += [(tok.start[0] + k, line, ("doc", tok.start[0])) for k, line in enumerate(tok.string.splitlines())]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z_][A-Za-z_'-]{2,}", FILLER.sub(" ", RULE_ID.sub(" ", text.split("noqa")[0])))


def bare_ids(path: Path, root: Path = ROOT) -> list[str]:
    found = _comment_lines(path.read_text(encoding="utf-8"))
    by_line = {n: (text, block) for n, text, block in found}
    bare = []
    for n, text, block in found:
        if not RULE_ID.search(text.split("noqa")[0]) or len(_words(text)) >= 3:
            continue
        near = [by_line.get(m) for m in (n - 1, n + 1)]
        if not any(x and x[1] == block and block != "inline" and len(_words(x[0])) >= 3 for x in near):
            bare.append(f"{path.relative_to(root)}:{n}: {text.strip()}")
    return bare


def test_every_rule_id_in_a_comment_comes_with_words() -> None:
    files = subprocess.run(["git", "ls-files", *(f"{p}/*.py" for p in PACKAGES)], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    assert len(files) > 100
    bare = [line for f in files for line in bare_ids(ROOT / f)]
    assert not bare, "\n".join(bare)


def test_the_check_finds_a_bare_id(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("x = 1  # J-4\ny = 2  # journal overflow: stop journaling (J-4)\n")
    assert bare_ids(tmp_path / "x.py", tmp_path) == ["x.py:1: J-4"]
