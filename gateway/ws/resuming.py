"""The resume handshake (protocol.md §6.4 RS1-RS9) and takeover (§6.5) on a new socket.

Everything up to the write of `session.resumed` changes nothing a client can see: on failure the old token,
the old socket or the grace timer stay as they were. The session writer's lock is held from the lease
compare-and-set to the attach, so `session.resumed` and the replay precede every live event (RS9) and no
event can slip between the replay cut and the attach.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket

from gateway.admission import SlotState
from gateway.protocol.errors import CloseCode, Effect, ProtocolError
from gateway.protocol.profiles import Profile
from gateway.resume.journal import JournalGap, resync_required_event
from gateway.resume.procedure import ResumeRequest, check_resume, commit_resume, prepare_resume
from gateway.session.outbox import Kind, OutItem
from gateway.state import GatewayState
from gateway.ws.handshake import ConnectionParams
from gateway.ws.live import LiveSession, replay_texts
from gateway.ws.messages import ResyncClose

REPLACED_CLOSE = (int(CloseCode.NORMAL), "session_replaced")
RESYNC_CLOSE = (int(CloseCode.NORMAL), "resync_required")


async def resume_session(gw: GatewayState, params: ConnectionParams, ws: WebSocket, fields: dict[str, Any], *,
                         send_and_close: Callable[[OutItem, Profile], Awaitable[None]]
                         ) -> tuple[LiveSession, int | None]:
    """Returns the session and this socket's attachment generation (None: answered with a resync).
    `send_and_close` is the connection's: it writes a handshake answer on `ws` and closes it."""
    req = ResumeRequest.parse(fields)  # fields present and well-typed, else invalid_session_resume (RS1)
    target = gw.sessions.get(req.session_id)
    assert target is None or isinstance(target, LiveSession)  # only LiveSession.start registers a session
    route, profile = params.route, params.profile.value
    try:
        # session live, token, route and profile, cursor, no journal gap (RS2-RS6)
        check_resume(req, target, route=route, profile=profile)
    except JournalGap:  # J-5: tell the client, end the session, close this socket with 1000
        assert target is not None
        target.attachments.mark_unresumable()
        target.post(ResyncClose())
        ev = resync_required_event(req.session_id, "journal_gap", target.journal.last_seq)
        await send_and_close(OutItem(events=(ev,), kind=Kind.UNSEQUENCED, close=RESYNC_CLOSE), params.profile)
        gw.metrics.resume_result("resync_required")
        return target, None
    assert target is not None
    expected = gw.leases.generation(req.session_id)
    writer = target.writer
    async with target.attachments.resume_lock, writer.lock:  # RS7: one resume at a time, no live sends
        plan = prepare_resume(req, target, gw.leases, expected, route=route, profile=profile)
        resumed = writer.frames(plan.resumed_event(target, target.created_json()), False)
        if not all([await writer.send(t, ws) for t in resumed]):
            raise ProtocolError("runtime_resume_failed", "session.resumed could not be written",
                                effect=Effect.HANDSHAKE)  # nothing was committed: old token and timer stand
        old_socket, old_generation = writer.socket, writer.generation
        # activate (RS8): takeover of an attached socket, generation + 1, new token, grace timer stopped
        takeover = commit_resume(target, plan, gw.leases)
        gw.admission.set_state(req.session_id, SlotState.OPEN)
        replaced = takeover.replaced_event(req.session_id)
        # the old socket gets session.replaced, unsequenced and never journaled, then close 1000 (TK-2)
        if replaced is not None and old_socket is not None:
            for t in writer.frames(replaced, False):
                await writer.send(t, old_socket)
            await writer.close_socket(*REPLACED_CLOSE, socket=old_socket)
            gw.metrics.takeovers.inc()
        target.release(old_generation)
        target.attach(ws, takeover.new_generation)
        for text in replay_texts(plan.replay):  # RS9 / J-6: byte-exact, in order, before live events
            if not await writer.send(text):
                break
    gw.metrics.resume_result("ok")
    return target, takeover.new_generation
