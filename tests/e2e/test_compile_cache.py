"""The stages' torch.compile output lives under `duplex serve --cache-dir` (a volume in docker-compose.yml and the
k8s manifest), and a restart loads it instead of compiling again: the real launcher, tritonserver and stage stubs,
tiny checkpoint on CPU, a profile whose Token2Wav compiles its HiFT (tests/e2e/profiles/compile-hift.yaml)."""

from __future__ import annotations

from pathlib import Path

from serve.launcher import ensure_tiny_checkpoint
from serve.tritonserver import COMPILE_CACHE_ENV, COMPILE_CACHE_NAME
from tests.e2e.stack import REPO_ROOT, Stack

PROFILE = REPO_ROOT / "tests" / "e2e" / "profiles" / "compile-hift.yaml"


def _serve_once(cache: Path, compiled: Path) -> dict[str, int]:
    """Start the stack until /ready (the warm-up compiles), stop it; the compiled graphs' files and mtimes."""
    # An empty value is unset: the launcher's default place applies even where the caller's environment has one.
    stack = Stack(cache, profile=PROFILE, env={COMPILE_CACHE_ENV: ""})
    stack.start()
    try:
        return {str(p.relative_to(compiled)): p.stat().st_mtime_ns for p in compiled.rglob("*") if p.is_file()}
    finally:
        stack.stop()


def test_a_restart_loads_what_the_first_start_compiled(e2e_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-checkpoint").symlink_to(ensure_tiny_checkpoint(e2e_cache))  # generated once per test session
    compiled = cache / COMPILE_CACHE_NAME / "fxgraph"  # inductor's compiled graphs, keyed by graph and settings
    first = _serve_once(cache, compiled)
    assert first, f"the warm-up compiled nothing under {compiled}"
    again = _serve_once(cache, compiled)
    # a graph compiled again (a miss) writes its entry again: a new file or a new mtime
    assert again == first
