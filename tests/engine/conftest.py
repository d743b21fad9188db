import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# Two cores shared by many tests: keep torch single-threaded so timings and CI stay predictable.
torch.set_num_threads(1)

TINY_SEED = 0
# The tiny-checkpoint builder is imported by module name from build/ (`import build.x` would hit the
# PyPI `build` package wherever that is installed).
BUILD_DIR = str(Path(__file__).resolve().parents[2] / "build")
if BUILD_DIR not in sys.path:
    sys.path.insert(0, BUILD_DIR)


def vision_available() -> bool:
    return importlib.util.find_spec("engine.model.vision") is not None


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny checkpoint (model.md §9.2), built once per test session. Treat as read-only."""
    from make_tiny_checkpoint import build_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-minicpmo45")
    return build_tiny_checkpoint(out, TINY_SEED, vision=vision_available())
