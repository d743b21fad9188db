"""The Stage0 step loop is a scheduler with its own state, not half of the engine's class (issue 19).

Walks `engine/stage0/*.py` with `ast` (nothing is imported). The old layout spread one object over three
files as a base-class chain (`Stage0Engine(StepLoop)`, `StepLoop(StepRecovery)`, `StepRecovery(EngineParts)`),
so each file wrote attributes the others declared. Now a class may only extend a class of its own file, and
no file assigns attributes of another file's object through a reference to it (`engine.x = ...`).
"""

from __future__ import annotations

import ast
from pathlib import Path

STAGE0 = Path(__file__).resolve().parents[2] / "engine" / "stage0"


def _modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text()) for path in sorted(STAGE0.glob("*.py"))}


def test_no_class_extends_a_class_of_another_stage0_file() -> None:
    modules = _modules()
    home = {node.name: name for name, tree in modules.items() for node in tree.body if isinstance(node, ast.ClassDef)}
    crossing = []
    for name, tree in modules.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if isinstance(base, ast.Name) and home.get(base.id, name) != name:
                        crossing.append(f"{name}: {node.name}({base.id} of {home[base.id]})")
    assert not crossing, crossing


def test_the_engine_and_its_scheduler_write_only_their_own_attributes() -> None:
    """`self.scheduler.x = ...` in the engine (or `self.table.x = ...` anywhere) would make two writers."""
    foreign = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Attribute)
                            and isinstance(e.value.value, ast.Name) and e.value.value.id == "self"
                            and e.value.attr in {"scheduler", "table", "recovery", "engine", "prefix"}):
                        foreign.append(f"{name}:{node.lineno}: self.{e.value.attr}.{e.attr}")
    assert not foreign, foreign


def test_the_engine_has_a_scheduler_part() -> None:
    engine = next(n for n in _modules()["engine.py"].body if isinstance(n, ast.ClassDef) and n.name == "Stage0Engine")
    assert not engine.bases
    assert "scheduler" in {e.attr for n in ast.walk(engine) if isinstance(n, ast.Assign) for e in n.targets
                           if isinstance(e, ast.Attribute)}
