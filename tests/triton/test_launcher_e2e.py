"""The launcher finds and starts the real tritonserver and reports startup failures clearly."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from serve.launcher import LaunchError, TritonInstall, TritonServer, choose_triton_ports
from tests.ports import free_port

from .conftest import free_ports, start_server

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_locates_wheel_binary_and_stub(triton_install: TritonInstall) -> None:
    assert triton_install.binary.exists()
    assert (triton_install.backend_dir / "python" / "triton_python_backend_stub").exists()
    assert (triton_install.backend_dir / "python" / "libtriton_python.so").exists()


def test_triton_ports_follow_the_gateway_port_when_free() -> None:
    base = free_port()  # with base+1..+3 free and this worker's alone
    assert list(choose_triton_ports(base).all().values()) == [base + 1, base + 2, base + 3]


def test_triton_ports_are_picked_free_when_a_derived_one_is_taken() -> None:
    base = free_port()  # with base+1..+3 free and this worker's alone
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", base + 2))
        busy.listen()
        ports = list(choose_triton_ports(base).all().values())
    assert base + 2 not in ports and base not in ports and len(set(ports)) == 3
    assert 8002 not in choose_triton_ports(8002).all().values()


def test_starts_and_serves_stage0(triton_install: TritonInstall, torch_repo: Path, tmp_path: Path) -> None:
    server = start_server(triton_install, torch_repo, tmp_path / "t.log", models=("stage0",))
    try:
        assert server.is_ready()
    finally:
        server.stop()
    assert server.proc is None


def test_taken_port_is_reported(triton_install: TritonInstall, loopback_repo: Path, tmp_path: Path) -> None:
    ports = free_ports()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.grpc))
        busy.listen()
        server = TritonServer(triton_install, loopback_repo, ["stage0"], ports, tmp_path / "t.log")
        with pytest.raises(LaunchError, match=rf"port {ports.grpc} \(Triton gRPC\) is already in use"):
            server.start()


@pytest.mark.parametrize("broken", ["engine_factory", "checkpoint_dir"])
def test_failing_model_load_error_is_surfaced(triton_install: TritonInstall, torch_repo: Path, tiny_checkpoint: Path,
                                              tmp_path: Path, broken: str) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(torch_repo / "stage0", repo / "stage0")
    config = repo / "stage0" / "config.pbtxt"
    old, new = {"engine_factory": ("model_repository.common.bridges:stage0",
                                   "model_repository.common.bridges:no_such_factory"),
                "checkpoint_dir": (str(tiny_checkpoint), "/no/such/checkpoint")}[broken]
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    server = TritonServer(triton_install, repo, ["stage0"], free_ports(), tmp_path / "t.log")
    server.start()
    try:
        with pytest.raises(LaunchError) as err:
            server.wait_ready(60, progress=lambda _m: None)
    finally:
        server.stop()
    message = str(err.value)
    assert "stage0" in message and new.rsplit(":", 1)[-1] in message


def _duplex(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serve.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)


def test_cli_bad_profile_and_unknown_subcommand(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("max_sessions: -1\n")
    done = _duplex("serve", "--profile", str(bad), "--port", str(free_ports().http), "--cache-dir", str(tmp_path))
    assert done.returncode == 2 and "'max_sessions'" in done.stderr
    done = _duplex("dance")
    assert done.returncode == 2 and "unknown subcommand 'dance'" in done.stderr


def test_cli_reports_taken_gateway_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _duplex("serve", "--port", str(port), "--cache-dir", str(tmp_path))
    assert done.returncode == 2
    assert f"port {port} (gateway) is already in use" in done.stderr
