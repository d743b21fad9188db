"""HTTP routes (protocol.md §11): models, health, readiness, capabilities, metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.state import GatewayState

router = APIRouter()


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness only: never contacts Triton (§11.2)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    ok, checks, reasons = await _state(request).readiness()
    if ok:
        return JSONResponse({"status": "ready", "checks": checks})
    return JSONResponse({"status": "not_ready", "checks": checks, "reasons": reasons}, status_code=503)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    s = _state(request).settings
    entry = {"object": "model", "created": s.model_created, "owned_by": "minicpm-duplex",
             "capabilities": {"realtime": True, "duplex": True}}
    return {"object": "list", "data": [dict(entry, id=name) for name in (s.model_name, *s.model_aliases)]}


@router.get("/v1/duplex/capabilities")
async def capabilities(request: Request) -> dict[str, Any]:
    st = _state(request)
    return dict(st.capabilities, active_sessions=len(st.admission))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format 0.0.4 (§10.4, §11.5)."""
    body, ctype = _state(request).metrics.render()
    return Response(body, media_type=ctype)
