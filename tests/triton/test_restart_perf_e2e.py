"""A tritonserver restart is seen by the client; a short perf_analyzer run completes.

The restart is that of a server of the test's own, with the loopback stand-in engines (the client's view of a
restart does not depend on the engines, and that server starts in seconds, not tens of them); perf_analyzer
runs against the session's real-engine server (`torch_server`), whose log is checked from where the run began.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, TritonSession, TritonUnavailable
from serve.launcher import TritonInstall, TritonServer

from .conftest import ALL_MODELS, free_ports, start_server

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
PERF_TIMEOUT_S = 120


def test_restart_is_detected_and_reported(triton_install: TritonInstall, loopback_repo: Path,
                                          tmp_path: Path) -> None:
    ports = free_ports()
    server = start_server(triton_install, loopback_repo, tmp_path / "a.log", ports=ports)
    session = TritonSession(server.grpc_url, model="duplex")
    try:
        session.request("open", (1, 1, 0))
        server.stop()  # graceful, like a restart; SIGKILL would leak the stubs' /dev/shm regions
        with pytest.raises(TritonUnavailable, match="triton_unavailable"):
            session.request("append", (1, 1, 1), pcm=np.zeros(FIRST_UNIT_SAMPLES, np.float32), timeout_s=10)
    finally:
        session.close()
    server = start_server(triton_install, loopback_repo, tmp_path / "b.log", ports=ports)
    try:
        again = TritonSession(server.grpc_url, model="duplex", corrid=session.corrid)
        try:  # the old session's state is gone with the old server
            with pytest.raises(KeyError, match="session_not_found"):
                again.request("append", (1, 1, 1), pcm=np.zeros(FIRST_UNIT_SAMPLES, np.float32))
            assert again.request("open", (1, 1, 0)).of_type("opened")
            reply = again.request("append", (1, 1, 1), pcm=np.zeros(FIRST_UNIT_SAMPLES, np.float32))
            assert reply.of_type("decision") and reply.events[-1]["type"] == "unit_done"  # the new server serves
        finally:
            again.close()
    finally:
        server.stop()


@pytest.mark.parametrize("model", ["stage0", "duplex"])
def test_perf_analyzer_short_run(torch_server: TritonServer, tmp_path: Path, model: str) -> None:
    """perf_analyzer's sessions (gRPC streaming, sequences, two at once) on one stage and on the whole
    pipeline; the duplex stubs must survive it (this run used to kill one within seconds, docs/triton.md)."""
    assert set(ALL_MODELS) <= set(torch_server.models) and torch_server.is_ready()
    start = Path(torch_server.log_path).stat().st_size
    env = {**os.environ, "TRITON_GRPC_URL": torch_server.grpc_url, "PA_MEASURE_MS": "1000", "PA_CONCURRENCY": "2"}
    done = subprocess.run(["bash", "bench/perf_analyzer.sh", model, "--sequence-length", "4",
                           "--max-trials", "6", "-s", "200", "-f", str(tmp_path / "pa.csv")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=PERF_TIMEOUT_S, check=False)
    healthy = torch_server.is_ready()
    with open(torch_server.log_path, "rb") as f:
        f.seek(start)
        log = f.read().decode(errors="replace")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Concurrency: 2, throughput:" in done.stdout
    rows = (tmp_path / "pa.csv").read_text().splitlines()
    assert len(rows) == 2 and float(rows[1].split(",")[1]) > 0  # inferences/s
    assert healthy and "not healthy" not in log and "Segmentation fault" not in log
