"""Fixtures for the Triton tests: generated model repositories and real tritonservers.

`torch_server` serves the real engine/ stage engines on the seeded tiny checkpoint (CPU, the default
deploy profile), one server for the whole test session; `loopback_server` serves the torch-free test
double (tests/triton/loopback.py) for the plumbing tests that pin exact decisions. Each server runs in
its own process group and is stopped (gracefully: Triton then frees its /dev/shm) at teardown.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# build/ goes on sys.path and its modules are imported by name: `build` is also a PyPI package.
BUILD_DIR = str(Path(__file__).resolve().parents[2] / "build")
if BUILD_DIR not in sys.path:
    sys.path.insert(0, BUILD_DIR)

from make_model_repository import REPO_ROOT, DeployProfile, build_repository  # noqa: E402
from make_tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

from serve.launcher import (  # noqa: E402
    DEFAULT_CACHE_DIR,
    TritonInstall,
    TritonPorts,
    TritonServer,
    locate_tritonserver,
)
from tests.e2e.stack import stop_soon, wait_stopped  # noqa: E402
from tests.ports import free_port  # noqa: E402

READY_TIMEOUT_S = 120.0
ALL_MODELS = ("stage0", "tts", "token2wav", "duplex")
LOOPBACK = DeployProfile(engine="tests.triton.loopback", max_sessions=4, pipeline_instances=2)
TINY_SEED = 0


def default_profile(**overrides: object) -> DeployProfile:
    """deploy/profiles/default.yaml (real engines on CPU), as `duplex serve` uses it."""
    return DeployProfile.load(REPO_ROOT / "deploy" / "profiles" / "default.yaml", **overrides)


def free_ports() -> TritonPorts:
    return TritonPorts(http=free_port(), grpc=free_port(), metrics=free_port())


@pytest.fixture(scope="session")
def triton_install() -> TritonInstall:
    return locate_tritonserver(DEFAULT_CACHE_DIR)


@pytest.fixture(scope="session")
def loopback_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository("/nonexistent-checkpoint", LOOPBACK, tmp_path_factory.mktemp("repo") / "models")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny checkpoint (random weights), built once per test session; read-only."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), TINY_SEED, vision=True)  # camera frames


@pytest.fixture(scope="session")
def torch_repo(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    # The default profile plus options that change no output: the engine_options path is served too, and the TTS
    # batches continuously here (units join and leave between single-code steps), so the real-engine e2e tests
    # (streams, cancels, closes, the stress test) cover that path; the gateway's e2e tests serve the default
    # (whole units) through deploy/profiles/default.yaml.
    profile = default_profile(engine_options={"token2wav": {"flow_dtype": "float32"}, "tts": {"continuous": True}})
    return build_repository(str(tiny_checkpoint), profile, tmp_path_factory.mktemp("repo") / "models")


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


@pytest.fixture(scope="session")
def background_stops() -> Iterator[None]:
    """Servers no test needs any more stop on threads of their own; the session ends after they did."""
    yield
    wait_stopped()


@pytest.fixture(scope="module")
def loopback_server(triton_install: TritonInstall, loopback_repo: Path, tmp_path_factory: pytest.TempPathFactory,
                    background_stops: None) -> Iterator[TritonServer]:
    server = start_server(triton_install, loopback_repo, tmp_path_factory.mktemp("log") / "triton.log")
    try:
        yield server
    finally:
        # graceful (a killed server leaks its stubs' /dev/shm regions, 64 MiB each), while the next tests run
        stop_soon(server.stop, "loopback-server")


@pytest.fixture(scope="session")
def torch_server(triton_install: TritonInstall, torch_repo: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    server = start_server(triton_install, torch_repo, tmp_path_factory.mktemp("log") / "triton.log")
    try:
        yield server
    finally:
        server.stop()  # graceful: a killed server leaks its stubs' /dev/shm regions (64 MiB each)
