"""ARCHITECTURE.md: the gateway never imports torch or `engine`, nor `serve` (the process manager that starts it)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import gateway


def test_gateway_imports_neither_torch_nor_engine_nor_serve() -> None:
    mods = [m.name for m in pkgutil.walk_packages(gateway.__path__, "gateway.")]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "bad = sorted(n for n in sys.modules if n in ('torch', 'serve') or n.startswith(('torch.', 'engine', 'serve.')))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout
    assert "gateway.session.session" in mods and "gateway.runtime.triton" in mods
