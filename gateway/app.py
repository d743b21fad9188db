"""ASGI app factory: `create_app(settings) -> FastAPI` (run by the launcher under uvicorn)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import http
from gateway.runtime.base import Runtime
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.ws import routes


def create_app(settings: GatewaySettings | None = None, *, runtime: Runtime | None = None) -> FastAPI:
    """`runtime` is injectable for tests; by default the Triton runtime is built from the settings."""
    settings = settings if settings is not None else GatewaySettings.from_env()
    if runtime is None:
        from gateway.runtime.triton import TritonRuntime  # noqa: PLC0415 - tritonclient only when serving

        runtime = TritonRuntime(settings.triton_url, settings.triton_model, settings.triton_ready_models,
                                batch_dim=settings.triton_batch_dim)
    state = GatewayState(settings, runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.draining = True
        await runtime.aclose()

    app = FastAPI(title="MiniCPM-o 4.5 duplex gateway", lifespan=lifespan)
    app.state.gateway = state
    app.include_router(http.router)
    app.include_router(routes.router)
    return app
