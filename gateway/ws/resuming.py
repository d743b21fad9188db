"""The resume handshake (protocol.md §6.4 RS1-RS9) and takeover (§6.5) on a new socket.

Everything up to the write of `session.resumed` changes nothing a client can see: on failure the old token,
the old socket or the grace timer stay as they were. The session writer's lock is held from the lease
compare-and-set to the attach, so `session.resumed` and the replay precede every live event (RS9) and no
event can slip between the replay cut and the attach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.admission import SlotState
from gateway.protocol.errors import CloseCode, Effect, ProtocolError
from gateway.resume.journal import JournalGap, resync_required_event
from gateway.resume.procedure import ResumeRequest, check_resume, commit_resume, prepare_resume
from gateway.session.outbox import Kind, OutItem
from gateway.ws.live import LiveSession, replay_texts
from gateway.ws.messages import ResyncClose

if TYPE_CHECKING:
    from gateway.ws.connection import Connection

REPLACED_CLOSE = (int(CloseCode.NORMAL), "session_replaced")
RESYNC_CLOSE = (int(CloseCode.NORMAL), "resync_required")


async def resume_session(conn: Connection, fields: dict[str, Any]) -> tuple[LiveSession, int | None]:
    """Returns the session and this socket's attachment generation (None: answered with a resync)."""
    gw, params = conn.gw, conn.params
    assert params is not None
    req = ResumeRequest.parse(fields)  # RS1
    target = gw.sessions.get(req.session_id)
    route, profile = params.route, params.profile.value
    try:
        check_resume(req, target, route=route, profile=profile)  # RS2-RS6
    except JournalGap:  # J-5: tell the client, end the session, close this socket with 1000
        assert target is not None
        target.attachments.mark_unresumable()
        target.post(ResyncClose())
        ev = resync_required_event(req.session_id, "journal_gap", target.journal.last_seq)
        await conn.send_and_close(OutItem(events=(ev,), kind=Kind.UNSEQUENCED, close=RESYNC_CLOSE), params.profile)
        gw.metrics.resume_result("resync_required")
        return target, None
    assert target is not None
    expected = gw.leases.generation(req.session_id)
    writer = target.writer
    async with target.attachments.resume_lock, writer.lock:  # RS7: one resume at a time, no live sends
        plan = prepare_resume(req, target, gw.leases, expected, route=route, profile=profile)
        resumed = writer.frames(plan.resumed_event(target, target.created_json()), False)
        if not all([await writer.send(t, conn.ws) for t in resumed]):
            raise ProtocolError("runtime_resume_failed", "session.resumed could not be written",
                                effect=Effect.HANDSHAKE)  # nothing was committed: old token and timer stand
        old_socket, old_generation = writer.socket, writer.generation
        takeover = commit_resume(target, plan, gw.leases)  # RS8
        gw.admission.set_state(req.session_id, SlotState.OPEN)
        replaced = takeover.replaced_event(req.session_id)
        if replaced is not None and old_socket is not None:  # TK-2, unsequenced and never journaled
            for t in writer.frames(replaced, False):
                await writer.send(t, old_socket)
            await writer.close_socket(*REPLACED_CLOSE, socket=old_socket)
            gw.metrics.takeovers.inc()
        target.release(old_generation)
        target.attach(conn.ws, takeover.new_generation)
        for text in replay_texts(plan.replay):  # RS9 / J-6: byte-exact, in order, before live events
            if not await writer.send(text):
                break
    gw.metrics.resume_result("ok")
    return target, takeover.new_generation
