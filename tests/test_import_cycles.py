"""No import cycles between the project's modules (issue 19).

Parses every module of the project's packages with `ast` (nothing is imported, so it runs in well
under a second) and fails if the module graph has a strongly connected component of more than one
module, printing each cycle.

Which imports make an edge:
- module-level imports, including those under `if TYPE_CHECKING:`, inside `try:` and in class
  bodies: they run at import time, or describe the real dependency (a type the module needs).
- NOT imports inside a function. A lazy import is sometimes the honest tool (an optional heavy
  dependency, a script entry point), but it is also how a cycle gets hidden; they are listed by
  `lazy_project_imports()` so a reader can see them, and `test_lazy_imports_close_no_cycle` checks
  that adding them back still closes no cycle.

Names resolve to the most specific module that exists: `from a.b import c` is an edge to `a.b.c`
when that is a module, else to `a.b` (the package `__init__`). Modules of `build/` are imported by
bare name (`build` is also a PyPI package, so scripts put `build/` on `sys.path`); those resolve too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "serve", "engine", "model_repository", "bench", "build", "clients")
BARE_NAME_DIRS = ("build",)  # folders whose modules are imported by bare name (on sys.path)

# Allowed components (each the sorted member list of one cycle), kept only for a cycle that cannot be cut
# yet, with the issue that will cut it. Empty: measured for issue 19 on 2026-12-01, every cycle was cut.
KNOWN_CYCLES: tuple[tuple[str, ...], ...] = ()

# The function-level imports today (see `lazy_project_imports()`), none of them hiding a cycle: optional
# or heavy parts loaded only when used (gateway.app's runtime and directory, gateway.settings' replicas,
# gateway.ws.routes' profiles, engine.model.minicpmo's submodules, engine.stage0.frontend's vision encoder,
# engine.loader's token2wav assets, the model_repository bridge factories) and script entry points in
# bench/, build/ and serve/.


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[module_name(path)] = path
    return mods


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with `lazy` = True when it sits inside a function."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, lazy = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, lazy
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            stack.append((child, inner))


def resolve(name: str) -> str | None:
    """The most specific project module `name` (dotted) refers to, or None outside the project."""
    mods = project_modules()
    candidates = [name] + [f"{d}.{name}" for d in BARE_NAME_DIRS]
    for cand in candidates:
        parts = cand.split(".")
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in mods and (end > 1 or cand == name):
                return prefix
    return None


def targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (target := resolve(alias.name)) is not None:
                yield target
        return
    base = node.module or ""
    if node.level:  # relative: strip `level` parts from the importing module's package
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    for alias in node.names:
        if (target := resolve(f"{base}.{alias.name}" if base else alias.name)) is not None:
            yield target


@cache
def import_edges() -> dict[str, dict[str, bool]]:
    """module -> {imported project module: lazy?} (an edge eager anywhere is eager)."""
    edges: dict[str, dict[str, bool]] = {}
    for module, path in project_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out: dict[str, bool] = {}
        for node, lazy in import_nodes(tree):
            for target in targets(node, module, path.name == "__init__.py"):
                if target != module:
                    out[target] = out.get(target, True) and lazy
        edges[module] = out
    return edges


def graph(include_lazy: bool) -> dict[str, set[str]]:
    return {m: {t for t, lazy in out.items() if include_lazy or not lazy}
            for m, out in import_edges().items()}


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def describe(g: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    lines = [f"cycle of {len(comp)} modules:"]
    for m in comp:
        lines.append(f"  {m} -> {', '.join(sorted(g[m] & members))}")
    return "\n".join(lines)


def lazy_project_imports() -> list[tuple[str, str]]:
    """(importer, imported) for every project import made only inside a function."""
    return sorted((m, t) for m, out in import_edges().items() for t, lazy in out.items() if lazy)


def unexpected_cycles(include_lazy: bool) -> list[str]:
    g = graph(include_lazy)
    return [describe(g, comp) for comp in strongly_connected(g) if tuple(comp) not in KNOWN_CYCLES]


def test_walker_sees_the_project() -> None:
    mods = project_modules()
    assert {"gateway.app", "serve.launcher", "engine.stage0.engine", "model_repository.common.adapter",
            "bench.loadgen.user", "build.make_tiny_checkpoint", "clients.cli"} <= set(mods)
    g = graph(include_lazy=False)
    assert "engine.stage0.config" in g["engine.stage0"]  # the package re-exports
    assert "build.tiny_checkpoint_files" in g["build.make_tiny_checkpoint"]  # bare-name import


def test_cycle_finder_finds_a_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert strongly_connected(g) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = unexpected_cycles(include_lazy=False)
    assert not cycles, "\n".join(cycles)


def test_lazy_imports_close_no_cycle() -> None:
    cycles = unexpected_cycles(include_lazy=True)
    assert not cycles, "\n".join(cycles) + "\n(a function-level import hides this cycle)"
