"""The two images: what they leave out of requirements/base.txt, the Triton stub swap, the build context."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

from tests.deploy.compose import REPO, dockerfile_arg

BASE = REPO / "requirements" / "base.txt"
NODEPS = REPO / "requirements" / "nodeps.txt"
STUB = "pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub"


def _pins(path: Path) -> dict[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return {name.lower(): version for name, _, version in (ln.partition("==") for ln in lines)}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_excluded_names_are_real_pins() -> None:
    """A renamed pin would silently stop being excluded: every excluded name must be pinned in base.txt."""
    pins = {_norm(n) for n in _pins(BASE)}
    for image, arg in (("gateway", "GATEWAY_EXCLUDE"), ("triton", "TRITON_EXCLUDE")):
        missing = [n for n in dockerfile_arg(image, arg).split() if _norm(n) not in pins]
        assert not missing, f"{image}: {arg} names {missing}, which requirements/base.txt does not pin"
    # The Triton image must not carry the wheel's tritonserver (the launcher would prefer it to the container's)
    # nor the CPU torch pin (a CUDA build comes from TORCH_INDEX_URL).
    assert {"nvidia-pytriton", "torch"} <= {_norm(n) for n in dockerfile_arg("triton", "TRITON_EXCLUDE").split()}
    kept = {_norm(n) for n in dockerfile_arg("gateway", "GATEWAY_NODEPS").split()}
    assert kept <= {_norm(n) for n in _pins(NODEPS)}


def test_gateway_imports_nothing_the_gateway_image_leaves_out() -> None:
    """Import every gateway and serve module (the image runs `duplex serve --only gateway`) with the excluded
    distributions' modules blocked (as in the image)."""
    excluded = {_norm(n) for n in dockerfile_arg("gateway", "GATEWAY_EXCLUDE").split()}
    excluded |= {_norm(n) for n in _pins(NODEPS)} - {_norm(n) for n in dockerfile_arg("gateway", "GATEWAY_NODEPS").split()}
    blocked = sorted({top for top, dists in metadata.packages_distributions().items()
                      if any(_norm(d) in excluded for d in dists) and not top.startswith("_")})
    assert "torch" in blocked and "transformers" in blocked, "the blocked set is derived from installed metadata"
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, pkgutil, sys
        BLOCKED = set({blocked!r})
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not installed in the gateway image")
        sys.meta_path.insert(0, Block())
        import gateway, serve
        for pkg in (gateway, serve):
            for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                importlib.import_module(mod.name)
        print("ok", len(sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def test_triton_image_takes_the_py311_stub_from_the_pinned_pytriton() -> None:
    """The Dockerfile copies the 3.11 stub and its hashed libcudart out of the wheel version base.txt pins."""
    version = dockerfile_arg("triton", "PYTRITON_VERSION")
    assert _pins(BASE)["nvidia-pytriton"] == version
    dist = metadata.distribution("nvidia-pytriton")
    assert dist.version == version
    root = Path(str(dist.locate_file("")))
    assert (root / STUB).is_file(), f"nvidia-pytriton {version} has no {STUB}"
    assert list((root / "nvidia_pytriton.libs").glob("libcudart-*.so.*")), "the stub's libcudart is missing"
    text = (REPO / "deploy" / "Dockerfile.triton").read_text()
    assert STUB in text and "nvidia_pytriton.libs/libcudart-*.so.*" in text


def test_build_context_keeps_secrets_and_local_state_out() -> None:
    ignored = {ln.strip().rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".env", ".git", ".venv", ".cache", "checkpoints"} <= ignored
    needed = {"gateway", "serve", "engine", "model_repository", "build", "deploy", "requirements", "pyproject.toml"}
    assert not needed & ignored, f"the images need {sorted(needed & ignored)}"
