"""The offline bundle's trimming rules (scripts/pack_wheels.py), applied to the nvidia-pytriton install in
this venv, and a repacked wheel that pip installs. Nothing is downloaded."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import pack_wheels  # noqa: E402

pytriton = pytest.importorskip("pytriton")
SITE = Path(pytriton.__file__).resolve().parents[1]


def _installed_members() -> list[str]:
    roots = [SITE / "pytriton" / "tritonserver", SITE / "nvidia_pytriton.libs"]
    return [str(p.relative_to(SITE)) for root in roots for p in root.rglob("*") if p.is_file()]


def _needed(member: str) -> list[str]:
    return pack_wheels.elf_needed(SITE / member)


def test_triton_rule_keeps_server_backend_one_stub_and_the_linked_libraries() -> None:
    keep = pack_wheels.triton_members(_installed_members(), _needed, "3.12")
    stubs = sorted(m for m in keep if m.startswith(pack_wheels.STUBS))
    assert stubs == [pack_wheels.STUBS + "3.12/triton_python_backend_stub"]
    assert "pytriton/tritonserver/bin/tritonserver" in keep
    assert "pytriton/tritonserver/backends/python/libtriton_python.so" in keep
    assert "pytriton/tritonserver/backends/python/triton_python_backend_utils.py" in keep
    assert any(Path(m).name.startswith("libtritonserver") for m in keep)
    # the bundled libpython 3.13 belongs to the 3.13 stub only
    assert not any("libpython" in m for m in keep)
    libs = {Path(m).name for m in _installed_members() if m.startswith(pack_wheels.TRITON_LIBS)}
    for member in keep:  # closed: every bundled library a kept file links is kept
        if not member.endswith(".py"):
            assert {n for n in _needed(member) if n in libs} <= {Path(m).name for m in keep}, member


def test_missing_stub_names_the_versions_there() -> None:
    with pytest.raises(SystemExit, match="no stub for Python 2.7"):
        pack_wheels.triton_members(_installed_members(), _needed, "2.7")


def _wheel(path: Path) -> Path:
    files = {"demo/__init__.py": b"X = 1\n", "demo/data/big.bin": b"\0" * 1000, "demo/bin/tool": b"\x7fELF..",
             "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
             "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             "demo-1.0.dist-info/entry_points.txt": b"[console_scripts]\ndemo = demo.cli:main\n",
             "demo-1.0.dist-info/RECORD": b""}
    whl = path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return whl


def test_trimmed_wheel_is_stored_versioned_and_installs(tmp_path: Path) -> None:
    out = pack_wheels.repack(_wheel(tmp_path), tmp_path / "out", lambda n: not n.startswith("demo/data/"),
                             local_version="trim")
    assert out.name == "demo-1.0+trim-py3-none-any.whl"
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert "demo/data/big.bin" not in names and "demo-1.0+trim.dist-info/entry_points.txt" not in names
        assert "Version: 1.0+trim" in z.read("demo-1.0+trim.dist-info/METADATA").decode()
        record = z.read("demo-1.0+trim.dist-info/RECORD").decode().split()
        assert sorted(record) == sorted([pack_wheels._record_line(n, z.read(n)) for n in names
                                         if not n.endswith("RECORD")] + ["demo-1.0+trim.dist-info/RECORD,,"])
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--disable-pip-version-check", "--target", str(target), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (target / "demo" / "__init__.py").read_text() == "X = 1\n"
    assert not (target / "demo" / "data").exists()
    assert os.access(target / "demo" / "bin" / "tool", os.X_OK)  # tritonserver must stay executable


def test_the_bundle_keeps_the_one_vad_model_the_gateway_reads() -> None:
    """offline_bundle.sh's silero-vad globs against the installed package's files: the gateway's model stays, the
    other exports (and the torch files) go."""
    from gateway.vad.model import MODEL_FILE, default_model_path

    script = (REPO / "scripts" / "offline_bundle.sh").read_text()
    rule = script[script.index("silero-vad) "):].split(";;")[0]
    globs = [g.strip("'") for g in rule.split("--drop", 1)[1].replace("\\\n", " ").split()]
    data = default_model_path().parent
    kept = {p.name for p in data.iterdir() if p.is_file()
            and not any(fnmatch.fnmatch(f"silero_vad/data/{p.name}", g) for g in globs)}
    assert MODEL_FILE in kept
    assert not {n for n in kept if n.endswith((".onnx", ".jit", ".safetensors"))} - {MODEL_FILE}
