"""The session actor: applies every inbox message exactly once, in arrival order, then closes the session.

Frames of a replaced socket are discarded here (TK-3, the attachment tag of §1.3); a lost socket detaches
a resumable session (§6.2); lease expiry (reaper), journal overflow, runtime death and shutdown end it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission import SlotState
from gateway.protocol import client_events as ce
from gateway.protocol import server_events as se
from gateway.protocol.errors import Effect, ProtocolError
from gateway.resume.attachment import LossAction
from gateway.session.outbox import Kind
from gateway.ws import faults
from gateway.ws.live import SHUTDOWN_CLOSE, LiveSession
from gateway.ws.messages import (
    Admitted,
    Disconnected,
    Expired,
    Fatal,
    JournalOverflow,
    LaneOut,
    OwnerLost,
    Rejected,
    ResyncClose,
    RuntimeOut,
    Shutdown,
    Tick,
)

CANCELS = (ce.ResponseCancel, ce.OutputAudioBufferClear, ce.BargeIn, ce.InputCancel)


@dataclass(slots=True)
class _End:
    reason: str = "disconnect"
    client_reason: str | None = None
    from_client: bool = False
    expired: bool = False


async def _handle(live: LiveSession, ev: ce.ClientEvent) -> None:
    """Lease and journal events are the host's; everything else is the session's."""
    session, gw = live.session, live.gw
    assert session is not None
    sid = session.session_id
    if isinstance(ev, ce.SessionHeartbeat):
        session.emit(se.HeartbeatAck(session_id=sid, lease_expires_in_s=gw.leases.heartbeat(sid)).model_dump(),
                     kind=Kind.UNSEQUENCED)
        return
    if isinstance(ev, ce.SessionEventAck):
        # trims the journal through that seq (J-2); a seq past the last one is invalid_event_ack, reject-frame
        live.journal.ack(ev.server_event_seq)
        return
    if isinstance(ev, CANCELS):
        # starts duplex_cancel_to_response_done_seconds: cancel accepted (K0) to response.done written (K8)
        live.meters.cancel_requested()
    await session.handle(ev)
    if isinstance(ev, ce.InputAudioBufferAppend):
        gw.metrics.appends.inc()
    elif isinstance(ev, ce.BargeIn):
        gw.metrics.barge_in("client")  # B1 is skipped for the client event: no overlap.decision to count
    elif isinstance(ev, ce.SessionUpdate):
        gw.leases.set_idle_ttl(sid, session.config.idle_timeout_s)


def _apply_error(live: LiveSession, err: ProtocolError) -> bool:
    """Route one error by its effect (§1.7). Returns True when the session must close."""
    session = live.session
    assert session is not None
    if err.code == "input_backpressure":
        live.gw.metrics.input_backpressure("turns" if "commit" in err.message else "bytes")
    try:
        if err.effect is Effect.REJECT_FRAME or err.effect is Effect.HANDSHAKE:
            live.outbox.put(faults.rejected_frame(err, err.client_event_id), reserved=True)
            return False
        if err.effect is Effect.FAIL_RESPONSE:
            session.fail_or_report(err)
            return False
        if err.effect is Effect.REPORT:
            session.emit_error(err, err.client_event_id)
            return False
        session.fail_or_report(err)
    except ProtocolError:
        pass  # the outbound queue is full: close anyway
    return True


async def _loop(live: LiveSession) -> _End:
    session, gw, att = live.session, live.gw, live.attachments
    assert session is not None
    sid = session.session_id
    while True:
        msg = await live.inbox.get()
        try:
            if isinstance(msg, Admitted):
                if not att.is_current(msg.generation):
                    continue  # TK-3: a replaced socket's frames have no effect and no reply
                live.credential.first_frame_received()  # the client holds the new token (§6.1)
                gw.leases.touch(sid)
                if isinstance(msg.event, ce.SessionClose):
                    return _End("client_close", msg.event.reason, True)
                try:
                    await _handle(live, msg.event)
                except ProtocolError as err:
                    err.client_event_id = msg.event.event_id
                    if _apply_error(live, err):
                        return _End(faults.close_reason(err))
            elif isinstance(msg, Rejected):
                if att.is_current(msg.generation):
                    live.outbox.put(faults.rejected_frame(msg.error, msg.error.client_event_id), reserved=True)
            elif isinstance(msg, RuntimeOut):
                live.meters.runtime_event(msg.event)
                session.on_runtime(msg.event)
            elif isinstance(msg, LaneOut):
                session.on_lane(msg.result)
            elif isinstance(msg, Tick):
                session.on_tick(session.clock())
            elif isinstance(msg, Fatal):
                _apply_error(live, msg.error)
                return _End(faults.close_reason(msg.error))
            elif isinstance(msg, Disconnected):
                out = att.on_socket_lost(msg.generation, transport_error=msg.reason == "transport_error")
                if out.action is LossAction.DETACH:  # §6.2: slot and runtime kept, grace timer starts
                    live.writer.detach(msg.generation)
                    live.release(msg.generation)
                    gw.leases.detach(sid)
                    gw.admission.set_state(sid, SlotState.DETACHED)
                elif out.action is LossAction.CLOSE:
                    return _End(out.reason or msg.reason)
            elif isinstance(msg, Expired):
                return _End(msg.reason, expired=True)
            elif isinstance(msg, JournalOverflow):
                gw.metrics.journal_overflows.inc()
                out = att.mark_unresumable()
                if out.action is LossAction.CLOSE:
                    return _End("journal_overflow")
            elif isinstance(msg, Shutdown):
                live.close_item = SHUTDOWN_CLOSE
                return _End("shutdown")
            elif isinstance(msg, ResyncClose):
                return _End("resync_required")
            elif isinstance(msg, OwnerLost):
                return await _owner_lost(live, msg)
        except ProtocolError as err:
            if _apply_error(live, err):
                return _End(faults.close_reason(err))
        except Exception as exc:  # noqa: BLE001 - mapped to internal_error, session closed
            _apply_error(live, faults.internal(exc))
            return _End("internal_error")


async def _owner_lost(live: LiveSession, msg: OwnerLost) -> _End:
    """Several gateways: the session's record is not this gateway's any more (it was counted dead, say cut off from
    Redis past its lease). The session ends here; its runtime close is local only (gateway/directory/runtime.py)."""
    if msg.moved:  # another gateway adopted it through a resume: this socket was taken over (TK-2)
        await live.replaced_elsewhere()
    else:  # swept (its sequence closed), or its record expired: the runtime binding is gone
        _apply_error(live, ProtocolError("runtime_dead", "the session's record in the session directory is gone"))
    return _End("runtime_failure")


async def run_actor(live: LiveSession) -> None:
    session = live.session
    assert session is not None
    end = await _loop(live)
    live.attachments.close()  # a resume racing the close gets session_resume_expired (RS2)
    if end.expired:
        live.close_item = faults.SESSION_EXPIRED
    live.gw.metrics.session_ended(end.reason)
    await session.close(end.reason, end.client_reason, from_client=end.from_client, expired=end.expired,
                        cleanup=live.cleanup)
