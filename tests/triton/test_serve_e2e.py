"""`duplex serve` end to end, and a spoken WAV streamed by two concurrent sessions through `duplex`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from clients.triton_example import Reply, TritonSession, read_wav_16k, units_of
from gateway.launcher import TritonServer

from .conftest import free_ports

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
SERVE_READY_S = 240.0


@pytest.fixture(scope="module")
def spoken_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (shutil.which("espeak-ng") and shutil.which("sox")):
        pytest.fail("espeak-ng and sox are required (make install puts them in)")
    folder = tmp_path_factory.mktemp("wav")
    raw, wav = folder / "raw.wav", folder / "hello16k.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), "hello, can you hear me? tell me a story"], check=True)
    subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav)], check=True)
    return wav


def _talk(url: str, pcm: np.ndarray, out: dict[int, list[Reply]], key: int) -> None:
    session = TritonSession(url, model="duplex")
    try:
        replies = [session.request("open", (1, 1, 0), config={"voice": "default"})]
        replies += [session.request("append", (1, 1, i + 1), pcm=u) for i, u in enumerate(units_of(pcm))]
        replies.append(session.request("close", (1, 1, 0)))
        out[key] = replies
    finally:
        session.close()


def test_spoken_wav_two_concurrent_sessions(loopback_server: TritonServer, spoken_wav: Path) -> None:
    pcm = read_wav_16k(str(spoken_wav))
    assert pcm.size > 16_480  # espeak made at least two units of speech
    out: dict[int, list[Reply]] = {}
    threads = [threading.Thread(target=_talk, args=(loopback_server.grpc_url, pcm * (k + 1), out, k))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(out) == [0, 1]
    for replies in out.values():
        units = replies[1:-1]
        assert [r.of_type("unit_done")[0]["unit"] for r in units] == list(range(len(units)))  # isolated per session
        assert all(r.of_type("decision") for r in units)
        assert any(r.of_type("text") for r in units)
        audio = [a for r in units for a in r.audio]
        assert audio and all(a.dtype == np.int16 for a in audio)
        assert replies[-1].of_type("closed")


def test_duplex_serve_starts_reports_ready_and_stops_cleanly(tmp_path: Path) -> None:
    port, triton = free_ports().http, free_ports()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
                             "--profile", str(REPO / "deploy" / "profiles" / "loopback.yaml"),
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
