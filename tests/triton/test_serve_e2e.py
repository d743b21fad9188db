"""`duplex serve` end to end with the default deploy profile (real engines, tiny checkpoint, CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, TritonSession

from .conftest import free_ports

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
SERVE_READY_S = 240.0


def test_duplex_serve_starts_serves_and_stops_cleanly(tmp_path: Path, tiny_checkpoint: Path) -> None:
    port, triton = free_ports().http, free_ports()
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", "--port", str(port),
                             "--checkpoint", str(tiny_checkpoint), "--cache-dir", str(tmp_path / "cache"),
                             "--triton-http-port", str(triton.http), "--triton-grpc-port", str(triton.grpc),
                             "--triton-metrics-port", str(triton.metrics)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + SERVE_READY_S
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "[serve] demo:" in line or "Triton serves gRPC" in line:
                break
        text = "".join(lines)
        assert "[triton] ready" in text, text
        if "[serve] demo:" in text:
            assert f"http://127.0.0.1:{port}/" in text
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as resp:
                assert resp.status == 200
        session = TritonSession(f"127.0.0.1:{triton.grpc}", model="duplex")  # the real engines answer
        try:
            session.request("open", (1, 1, 0), config={"seed": 0, "force_listen_count": 0})
            reply = session.request("append", (1, 1, 1), pcm=np.zeros(FIRST_UNIT_SAMPLES, np.float32))
            assert reply.of_type("decision") and reply.events[-1]["type"] == "unit_done"
            session.request("close", (1, 1, 0))
        finally:
            session.close()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)  # drains the pipe while serve shuts everything down
        assert proc.returncode == 0, rest[-2000:]
        assert "[serve] stopping" in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if proc.stdout is not None:
            proc.stdout.close()
    leftover = subprocess.run(["pgrep", "-f", f"tritonserver.*--http-port={triton.http}"], capture_output=True,
                              text=True, check=False)
    assert leftover.stdout.strip() == ""
