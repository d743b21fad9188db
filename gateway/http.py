"""HTTP routes (protocol.md §11): models, health, readiness, capabilities, metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

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
    return dict(st.capabilities, active_sessions=len(st.registry))


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """A minimal exposition of the gateway counters (§10.4 subset)."""
    st = _state(request)
    c = st.counters
    lines = [f"duplex_session_limit {st.settings.max_sessions}", f"duplex_sessions{{state=\"open\"}} {len(st.registry)}",
             f"duplex_ignored_binary_frames_total {c.ignored_binary_frames}"]
    lines += [f"duplex_stale_events_dropped_total{{type=\"{k}\"}} {v}" for k, v in sorted(c.stale_dropped.items())]
    lines += [f"duplex_admission_rejected_total{{code=\"{k}\"}} {v}" for k, v in sorted(c.admission_rejected.items())]
    lines += [f"duplex_sessions_ended_total{{reason=\"{k}\"}} {v}" for k, v in sorted(c.sessions_ended.items())]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
