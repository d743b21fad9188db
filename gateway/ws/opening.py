"""The open transaction (protocol.md §2.1 H4-H6): opener frame -> validated config -> admitted session.

Any failure undoes every earlier step (registry entry, admission slot, runtime reservation) before the error
is raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.protocol import client_events as ce
from gateway.protocol.codec import FrameLimits, decode_frame
from gateway.protocol.config import apply_patch, check_voice_source, default_config
from gateway.protocol.errors import Effect, ProtocolError
from gateway.runtime.base import SessionKey
from gateway.session import ids
from gateway.session.core import SessionLimits
from gateway.session.lane import LaneResult
from gateway.session.outbox import Outbox
from gateway.session.runtime_config import RuntimeDefaults
from gateway.session.session import DuplexSession
from gateway.session.units import UnitGeometry
from gateway.state import GatewayState
from gateway.ws.handshake import ConnectionParams


async def read_opener(next_text: Callable[[], Awaitable[str]], params: ConnectionParams, limits: FrameLimits,
                      timeout_s: float) -> tuple[ce.ClientEvent, dict[str, Any]]:
    """H3b/H4: the first frame within the handshake timeout; it must open or resume. For `session.resume`
    the second value is the raw frame (the fields `ResumeRequest.parse` checks)."""
    try:
        async with asyncio.timeout(timeout_s):
            text = await next_text()
    except TimeoutError:
        raise ProtocolError("config_timeout", "no opening frame", effect=Effect.HANDSHAKE) from None
    try:
        ev, raw = decode_frame(text, limits)
    except ProtocolError as err:
        err.effect = Effect.HANDSHAKE
        raise
    native = params.route == "/v1/duplex"
    allowed = ("session.resume",) if params.resume else (
        ("session.update", "session.create") if native else ("session.update",))
    if ev.type == "session.resume":
        return ev, raw  # a first frame may resume on either kind of socket (H4; procedure in §6.4)
    if ev.type not in allowed:
        err = ProtocolError("bad_event", f"{ev.type} cannot open a session", param="type", effect=Effect.HANDSHAKE)
        err.client_event_id = ev.event_id
        raise err
    assert isinstance(ev, ce.SessionUpdate | ce.SessionCreate)
    return ev, opener_session(ev, raw)


def opener_session(ev: ce.SessionUpdate | ce.SessionCreate, raw: dict[str, Any]) -> dict[str, Any]:
    """`session.create` may carry its fields under `session` or at the top level (§2.1 H4)."""
    if isinstance(ev, ce.SessionUpdate):
        return ev.session
    flat = {k: v for k, v in raw.items() if k not in ("type", "event_id", "session")}
    return {**flat, **(ev.session or {})}


async def open_session(state: GatewayState, params: ConnectionParams, session_patch: dict[str, Any] | None,
                       outbox: Outbox, post_lane: Callable[[LaneResult], None],
                       clock: Callable[[], float] = time.monotonic) -> DuplexSession:
    s = state.settings
    ctx = state.config_context(params.profile)
    base = default_config(ctx)
    if params.model is not None:
        resolved = ctx.resolve_model(params.model)
        if resolved is None:
            raise ProtocolError("model_not_found", f"model {params.model!r} is not served", param="model")
    config = base
    if session_patch is not None:
        config, touched = apply_patch(base, session_patch, ctx, opening=True, prefix_committed=False)
        if params.model is not None and "model" in touched and config.model != ctx.resolve_model(params.model):
            raise ProtocolError("bad_event", "session.model disagrees with the model query", param="session.model")
        check_voice_source(config, ctx)
    session_id = config.id or ids.session_id()
    state.registry.check_free(session_id)  # session_exists before capacity
    # one atomic check-and-reserve of a slot (AD-1); a refusal (resource_exhausted, close 1013) holds nothing
    state.admission.reserve(session_id)
    incarnation = state.registry.reserve(session_id)
    try:
        limits = SessionLimits(max_pending_input_bytes=s.max_pending_input_bytes_per_session,
                               max_pending_turns=s.max_pending_turns_per_session,
                               runtime_timeout_s=s.runtime_timeout_s, close_ack_timeout_s=s.close_ack_timeout_s,
                               idle_ttl_s=s.idle_ttl_s)
        session = DuplexSession(session_id=session_id, incarnation=incarnation, config=config, ctx=ctx,
                                limits=limits, runtime=state.runtime,
                                key=SessionKey(session_id, ids.correlation_id()), outbox=outbox,
                                post_lane=post_lane, clock=clock,
                                geometry=UnitGeometry(deadline_grace_s=s.unit_deadline_grace_s,
                                                      align_period_s=s.unit_align_s,
                                                      align_min_sessions=s.unit_align_min_sessions,
                                                      live_sessions=state.admission.live),
                                runtime_defaults=RuntimeDefaults(), capabilities=state.capabilities,
                                limits_json=s.limits_json())
        await session.open()
    except BaseException:
        state.admission.rollback(session_id)
        state.registry.release(session_id)
        raise
    return session
