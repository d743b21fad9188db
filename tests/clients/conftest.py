"""Fixtures: a gateway to talk to.

`gateway_url`: the gateway app in-process under uvicorn on a free loopback port, with the reactive fake
runtime (hermetic; tests may steer the fake through the `runtime` fixture), serving the web demo at `/` the
way the production app must. `real_gateway_url`: a running real stack named by `DUPLEX_TEST_GATEWAY_URL`
(e2e tests only; skipped when unset).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn

from clients import WEB_ROOT
from clients.audio import INPUT_RATE, PCM16_MAX
from tests.clients.reactive_runtime import ReactiveRuntime

GATEWAY_URL_ENV = "DUPLEX_TEST_GATEWAY_URL"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "clients"


@contextlib.asynccontextmanager
async def serve_gateway(runtime: Any, **overrides: Any) -> AsyncIterator[str]:
    from gateway.app import create_app  # noqa: PLC0415 - tests only; `clients` never imports gateway
    from gateway.serving import uvicorn_config  # noqa: PLC0415
    from gateway.settings import GatewaySettings  # noqa: PLC0415

    settings = GatewaySettings(**{"force_listen_count": 0, "tick_interval_s": 0.02, **overrides})
    app = create_app(settings, runtime=runtime)
    if not any(getattr(r, "path", None) in ("/", "") for r in app.routes):
        from starlette.staticfiles import StaticFiles  # noqa: PLC0415 - until the gateway mounts it itself

        app.mount("/", StaticFiles(directory=WEB_ROOT, html=True), name="web")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))  # the gateway's own transport
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
def runtime() -> ReactiveRuntime:
    return ReactiveRuntime(answer_units=2)


@pytest.fixture
async def gateway_url(runtime: ReactiveRuntime) -> AsyncIterator[str]:
    async with serve_gateway(runtime) as url:
        yield url


@pytest.fixture
def real_gateway_url() -> str:
    url = os.environ.get(GATEWAY_URL_ENV)
    if not url:
        pytest.skip(f"{GATEWAY_URL_ENV} is not set (needs the real tritonserver + gateway stack)")
    return url


def speech_like(ms: int, rate: int = INPUT_RATE, amp: float = 0.2, freq: float = 220.0) -> np.ndarray:
    """A voiced tone standing in for speech (the fake runtime only looks at energy)."""
    t = np.arange(rate * ms // 1000) / rate
    return (np.sin(2 * np.pi * freq * t) * amp * PCM16_MAX).astype(np.int16)


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
