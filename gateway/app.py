"""ASGI app factory: `create_app(settings) -> FastAPI` (run by the launcher under uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from gateway import http
from gateway.auth import HttpAuthMiddleware
from gateway.leases import ExpiryReason, Reaper
from gateway.looplag import LoopLagProbe
from gateway.runtime.base import Runtime
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.ws import routes
from gateway.ws.actor import run_actor
from gateway.ws.live import LiveSession
from gateway.ws.messages import Expired, Shutdown

# The browser demo (clients/web) next to this package; computed so the gateway imports no client code.
DEFAULT_WEB_ROOT = Path(__file__).resolve().parents[1] / "clients" / "web"


def web_root(settings: GatewaySettings) -> Path | None:
    if settings.web_root == "":
        return None
    root = Path(settings.web_root) if settings.web_root else DEFAULT_WEB_ROOT
    return root if root.is_dir() else None


def triton_runtime(settings: GatewaySettings) -> Runtime:
    """The served runtime (`triton_runtime_alone`), with each session recorded in the shared session directory
    when the settings name one (several gateways, gateway/directory)."""
    runtime = triton_runtime_alone(settings)
    if not settings.redis_url:
        return runtime
    from gateway.directory.runtime import DirectoryRuntime  # noqa: PLC0415
    from gateway.directory.store import SessionDirectory  # noqa: PLC0415
    from gateway.directory.sweep import Sweeper  # noqa: PLC0415

    assert settings.advertise_addr is not None  # the settings refuse a directory without it
    directory = SessionDirectory(settings.redis_url, settings.advertise_addr, settings.directory_lease_s,
                                 copy_ttl_s=settings.copy_ttl_s())
    # dead gateways' sequences are closed stage by stage (the settings refuse a directory in pipeline mode)
    sweeper = Sweeper(directory, settings.directory_lease_s, settings.runtime_timeout_s,
                      batch_dim=settings.triton_batch_dim, grace_s=settings.disconnect_grace_s)
    return DirectoryRuntime(runtime, directory, settings.triton_url, sweeper)


def triton_runtime_alone(settings: GatewaySettings) -> Runtime:
    """The served runtime: the gateway chaining the stages (on one Triton, or on several replicas), or the
    one-stream `duplex` pipeline (settings)."""
    # tritonclient is imported only when serving
    if settings.triton_replicas:
        if settings.triton_mode != "stages":
            raise ValueError("triton_replicas needs triton_mode=stages (the served path)")
        from gateway.runtime.replicas import ReplicaEndpoint, ReplicaRuntime  # noqa: PLC0415

        return ReplicaRuntime(tuple(ReplicaEndpoint.parse(s) for s in settings.triton_replicas),
                              settings.triton_ready_models, batch_dim=settings.triton_batch_dim,
                              probe_timeout_s=settings.ready_probe_timeout_s, retry_s=settings.replica_retry_s)
    if settings.triton_mode == "stages":
        from gateway.runtime.stages import StagedTritonRuntime  # noqa: PLC0415

        return StagedTritonRuntime(settings.triton_url, settings.triton_ready_models,
                                   batch_dim=settings.triton_batch_dim)
    from gateway.runtime.triton import TritonRuntime  # noqa: PLC0415

    return TritonRuntime(settings.triton_url, settings.triton_model, settings.triton_ready_models,
                         batch_dim=settings.triton_batch_dim)


async def drain(state: GatewayState) -> None:
    """Graceful stop, before the server closes its sockets: /ready turns red and new sessions are refused,
    every live session ends with `session.closed{shutdown}` and close 1001 (bounded by close_ack_timeout_s)."""
    state.draining = True
    for live in list(state.sessions.values()):
        live.post(Shutdown())
    if state.tasks:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(state.settings.close_ack_timeout_s):
                await asyncio.gather(*state.tasks, return_exceptions=True)


def create_app(settings: GatewaySettings | None = None, *, runtime: Runtime | None = None) -> FastAPI:
    """`runtime` is injectable for tests; by default the Triton runtime is built from the settings."""
    settings = settings if settings is not None else GatewaySettings.from_env()
    if runtime is None:
        runtime = triton_runtime(settings)
    state = GatewayState(settings, runtime)
    state.directory = getattr(runtime, "directory", None)  # a DirectoryRuntime's: resumes of others' sessions relay
    if state.directory is not None:  # several gateways: sessions are copied to Redis, a dead gateway's adopted
        state.replicate = runtime.replicate  # type: ignore[attr-defined]
        state.host_factory = lambda route, profile: LiveSession.for_adoption(state, route, profile, run_actor)

    async def on_expire(session_id: str, reason: ExpiryReason) -> None:
        live = state.sessions.get(session_id)
        if live is not None:
            live.post(Expired(reason.value))  # the actor alone mutates a session

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.reaper = Reaper(state.leases, on_expire, state.admission.retry_due)
        state.reaper.start()
        probe = LoopLagProbe(state.metrics.loop_lag.observe)
        probe.start()
        yield
        await probe.aclose()
        await drain(state)  # sockets are gone by now (see gateway.serving): detached sessions close here
        for task in list(state.tasks):
            task.cancel()
        await state.reaper.aclose()
        await runtime.aclose()

    app = FastAPI(title="MiniCPM-o 4.5 duplex gateway", lifespan=lifespan)
    app.state.gateway = state
    app.add_middleware(HttpAuthMiddleware, authenticator=state.auth)
    app.include_router(http.router)
    app.include_router(routes.router)
    root = web_root(settings)
    if root is not None:
        app.mount("/", StaticFiles(directory=root, html=True), name="web")
    return app
