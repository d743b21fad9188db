"""Fixtures for the Triton tests: a generated loopback repository and a real tritonserver.

Each server runs in its own process group and is killed with it at teardown, pass or fail.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from build.make_model_repository import DeployProfile, build_repository
from gateway.launcher import DEFAULT_CACHE_DIR, TritonInstall, TritonPorts, TritonServer, locate_tritonserver

READY_TIMEOUT_S = 120.0
ALL_MODELS = ("stage0", "tts", "token2wav", "duplex")
LOOPBACK = DeployProfile(engine="loopback", max_sessions=4, pipeline_instances=2)


def free_ports(n: int = 3) -> TritonPorts:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    return TritonPorts(http=ports[0], grpc=ports[1], metrics=ports[2])


@pytest.fixture(scope="session")
def triton_install() -> TritonInstall:
    return locate_tritonserver(DEFAULT_CACHE_DIR)


@pytest.fixture(scope="session")
def loopback_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository("/nonexistent-checkpoint", LOOPBACK, tmp_path_factory.mktemp("repo") / "models")


def start_server(install: TritonInstall, repo: Path, log: Path, models=ALL_MODELS,
                 ports: TritonPorts | None = None) -> TritonServer:
    server = TritonServer(install, repo, models, ports or free_ports(), log)
    server.start()
    try:
        server.wait_ready(READY_TIMEOUT_S, progress=lambda _m: None)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def loopback_server(triton_install: TritonInstall, loopback_repo: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    server = start_server(triton_install, loopback_repo, tmp_path_factory.mktemp("log") / "triton.log")
    try:
        yield server
    finally:
        server.stop()
