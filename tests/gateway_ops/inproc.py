"""An in-process gateway that also hands the test its app (for checks that need the server's side)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from gateway.app import create_app
from gateway.serving import DrainingServer, uvicorn_config
from gateway.settings import GatewaySettings
from tests.gateway.fake_runtime import FakeRuntime

TEST_DEFAULTS = {"force_listen_count": 0, "tick_interval_s": 0.02, "reaper_interval_s": 0.05}


@contextlib.asynccontextmanager
async def serve_app(rt: FakeRuntime, **overrides: Any) -> AsyncIterator[tuple[str, FastAPI, DrainingServer]]:
    settings = GatewaySettings(**{**TEST_DEFAULTS, **overrides})
    app = create_app(settings, runtime=rt)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = DrainingServer(uvicorn_config(app, settings, log_level="warning"), app.state.gateway)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes only this flag
        await asyncio.sleep(0.01)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", app, server
    finally:
        server.should_exit = True
        await task
        sock.close()
