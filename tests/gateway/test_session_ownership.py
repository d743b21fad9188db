"""Session state has owners (issue 19): every attribute of a session part is written by one class.

Walks `gateway/session/*.py` with `ast` (nothing is imported). For each object type (a class with its
in-package bases) an attribute assigned through `self.X = / +=` in two classes of that type has two writers,
which is what the old mixin tower had (15 such attributes over 7 classes). Also fails on hook stubs (a
method whose body is only `...`, overridden in another class) and on the session's state being assigned
from outside the package (`session.X = ...` in gateway/).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "gateway" / "session"


def _classes() -> dict[str, tuple[list[str], ast.ClassDef]]:
    found: dict[str, tuple[list[str], ast.ClassDef]] = {}
    for path in sorted(SESSION.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name] = ([b.id for b in node.bases if isinstance(b, ast.Name)], node)
    return found


def _self_writes(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def _lineage(name: str, classes: dict[str, tuple[list[str], ast.ClassDef]]) -> list[str]:
    out = [name]
    for base in classes[name][0]:
        if base in classes:
            out += _lineage(base, classes)
    return out


def test_every_session_attribute_has_one_writing_class() -> None:
    classes = _classes()
    assert {"DuplexSession", "InputTrack", "ResponseTrack"} <= classes.keys()
    writes = {name: _self_writes(node) for name, (_, node) in classes.items()}
    shared: dict[str, list[str]] = defaultdict(list)
    for name in classes:
        lineage = _lineage(name, classes)
        for attr in set().union(*(writes[c] for c in lineage)):
            writers = [c for c in lineage if attr in writes[c]]
            if len(writers) > 1:
                shared[f"{name}.{attr}"] = writers
    assert not shared, f"attributes written by more than one class: {dict(shared)}"


def test_no_hook_stubs() -> None:
    stubs = []
    for name, (bases, node) in _classes().items():
        if "Protocol" in bases:
            continue  # an interface: nothing inherits its bodies
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = [s for s in item.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                     and isinstance(s.value.value, str))]
                if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and body[0].value.value is Ellipsis:
                    stubs.append(f"{name}.{item.name}")
    assert not stubs, f"hook stubs (a `...` body for another class to override): {stubs}"


def test_nothing_outside_the_session_assigns_its_state() -> None:
    outside = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        if SESSION in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "session":
                        outside.append(f"{path.relative_to(ROOT)}:{node.lineno} session.{e.attr}")
    assert not outside, outside
