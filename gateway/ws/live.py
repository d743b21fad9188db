"""`LiveSession`: everything of a session that must outlive a socket (protocol.md §6).

inbox, actor, outbox, writer, journal, attachments and resume credential live here; a `Connection` only
receives frames (tagged with its attachment generation) into the inbox and lends its socket to the writer.

receive loop(s) --Admitted/Rejected/Disconnected--> inbox <--RuntimeOut-- runtime pump
                                                      ^ <--LaneOut, Tick, Expired (reaper), JournalOverflow
                                                    actor (gateway.ws.actor)
                                                      |
                                                    outbox --> writer --> journal (J-1) --> current socket
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.protocol.errors import CloseCode, ProtocolError
from gateway.protocol.profiles import Profile, Projector
from gateway.resume.attachment import Attachments, AttachState, Takeover
from gateway.resume.credentials import ResumeCredential
from gateway.resume.journal import Journal, JournalConfig, Sequencer, resync_required_event
from gateway.runtime.base import RuntimeFailure
from gateway.session.lane import LaneResult
from gateway.session.outbox import Kind, Outbox, OutboxLimits, OutItem
from gateway.session.session import DuplexSession
from gateway.state import GatewayState
from gateway.ws import faults
from gateway.ws.handshake import ConnectionParams
from gateway.ws.messages import Disconnected, Fatal, JournalOverflow, LaneOut, Message, RuntimeOut, Tick
from gateway.ws.meters import SessionMeters
from gateway.ws.writer import Json, Socket, Writer

SHUTDOWN_CLOSE = (int(CloseCode.GOING_AWAY), "shutdown")
REPLACED_CLOSE = (int(CloseCode.NORMAL), "session_replaced")  # the socket a takeover replaced closes so (TK-2)


class LiveSession:
    def __init__(self, gw: GatewayState, params: ConnectionParams) -> None:
        s = gw.settings
        self.gw = gw
        # a resume must come on the same route and profile as the session (RS4)
        self.route, self.profile = params.route, params.profile.value
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.outbox = Outbox(OutboxLimits(s.outbound_max_bytes, s.outbound_max_events, s.outbound_reserve_bytes,
                                          s.outbound_reserve_events))
        self.journal = Journal(JournalConfig(s.resume_replay_ttl_s, s.resume_replay_max_bytes_per_session))
        self.attachments = Attachments(resumable=True)
        self.credential, self._token = ResumeCredential.issue()
        self.writer = Writer(self.outbox, Projector(params.profile),
                             Sequencer(self.journal, self._resync_frame, lambda: self.post(JournalOverflow())),
                             on_drop=gw.metrics.stale_dropped_event, on_sent=self._after_send,
                             on_send_failed=lambda g: self.post(Disconnected("transport_error", g)),
                             on_text_sent=gw.metrics.transcript_delayed)
        self.session: DuplexSession | None = None
        self.released: dict[int, asyncio.Event] = {}  # per attachment: the socket is no longer this session's
        self.ended = asyncio.Event()
        self.close_item: tuple[int, str] = faults.SESSION_CLOSED
        self._cleanup_error: str | None = None
        self._drained = False
        self.meters = SessionMeters(gw.metrics)
        self._adopted_actor: Callable[[LiveSession], Awaitable[None]] | None = None

    # ---- ResumeTarget ----------------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        assert self.session is not None
        return self.session.session_id

    @property
    def incarnation(self) -> int:
        assert self.session is not None
        return self.session.incarnation

    def post(self, msg: Message) -> None:
        self.inbox.put_nowait(msg)

    def post_lane(self, result: LaneResult) -> None:
        self.post(LaneOut(result))

    # ---- start -----------------------------------------------------------------------------------------
    def start(self, session: DuplexSession, socket: Socket, *, echo_update: bool,
              actor: Callable[[LiveSession], Awaitable[None]]) -> int:
        """H6: bind the opened session, queue `session.created` (+ `session.updated`), start the host, which
        runs `actor` (gateway.ws.actor.run_actor, passed in: the actor module imports this one)."""
        self.session = session
        self.writer.is_stale = session.is_stale
        session.lane.on_submit = self.meters.unit_submitted
        session.bind_host(self.writer.last_seq, self.gw.vad_batcher, self.gw.settings.vad_onset_confirm_ms)
        sid = session.session_id
        gw = self.gw
        gw.sessions[sid] = self
        gw.leases.add(sid)
        gw.leases.set_idle_ttl(sid, session.config.idle_timeout_s)
        self.attach(socket, 1)
        created = {"type": "session.created", "session": session.session_json(),
                   "incarnation": session.incarnation, "attachment_generation": 1, "resume_token": self._token}
        self._token = ""  # the token string lives only in that one unsequenced event (§6.1)
        self.outbox.put(OutItem(events=(created,), kind=Kind.UNSEQUENCED))
        if echo_update:
            session.emit({"type": "session.updated", "session": session.session_json()})
        gw.spawn(self._host(actor), name=f"session-{sid}")
        gw.hosted(self)  # several gateways: its copy in the shared directory (gateway/directory/replica.py)
        return 1

    # ---- adoption (several gateways: a dead gateway's session, gateway/directory/adopt.py) --------------------
    @classmethod
    def for_adoption(cls, gw: GatewayState, route: str, profile: str,
                     actor: Callable[[LiveSession], Awaitable[None]]) -> LiveSession:
        live = cls(gw, ConnectionParams(route, Profile(profile), False, True, None, None))
        live._adopted_actor = actor
        return live

    def start_adopted(self, session: DuplexSession) -> None:
        """Host a session rebuilt from the directory, detached and without `session.created` (its journal,
        credential and attachments are restored already); the resume that adopted it attaches the socket."""
        assert self._adopted_actor is not None, "made by for_adoption"
        self._token = ""
        self.session = session
        self.writer.is_stale = session.is_stale
        session.lane.on_submit = self.meters.unit_submitted
        session.bind_host(self.writer.last_seq, self.gw.vad_batcher, self.gw.settings.vad_onset_confirm_ms)
        self.gw.sessions[session.session_id] = self
        self.gw.spawn(self._host(self._adopted_actor), name=f"session-{session.session_id}")
        self.gw.hosted(self)

    async def replaced_elsewhere(self) -> None:
        """Another gateway adopted this session through a resume (gateway/directory/runtime.py): to the socket
        attached here that resume is a takeover, so it gets `session.replaced` and close 1000 (TK-2), and nothing
        the session emits here from now on reaches a client."""
        writer, att = self.writer, self.attachments
        async with writer.lock:  # no live send between these frames
            socket, generation = writer.socket, writer.generation
            if socket is not None and att.state is AttachState.ATTACHED:
                replaced = Takeover(generation + 1, generation).replaced_event(self.session_id)
                assert replaced is not None
                for text in writer.frames(replaced, False):
                    await writer.send(text, socket)
                await writer.close_socket(*REPLACED_CLOSE, socket=socket)
            writer.detach(generation)
        att.close()
        self.release(generation)

    def attach(self, socket: Socket, generation: int) -> None:
        self.writer.attach(socket, generation)
        self.released[generation] = asyncio.Event()

    def release(self, generation: int) -> None:
        ev = self.released.pop(generation, None)
        if ev is not None:
            ev.set()

    # ---- host ------------------------------------------------------------------------------------------
    async def _host(self, actor: Callable[[LiveSession], Awaitable[None]]) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self.writer.run(), name="writer")
                aux = [tg.create_task(self._pump_runtime(), name="runtime-pump"),
                       tg.create_task(self._tick(), name="ticker")]
                await actor(self)
                for t in aux:
                    t.cancel()
                self.outbox.put(OutItem(events=(), kind=Kind.UNSEQUENCED, close=self.close_item), reserved=True)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.gw.settings.close_ack_timeout_s):
                        await asyncio.shield(writer)
                writer.cancel()
        finally:
            self.ended.set()
            for g in list(self.released):
                self.release(g)

    async def _pump_runtime(self) -> None:
        session = self.session
        assert session is not None
        try:
            async for ev in self.gw.runtime.events(session.key):
                self.post(RuntimeOut(ev))
            if session.state == "open":
                self.post(Fatal(ProtocolError("runtime_dead", "runtime stream ended")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the binding is gone whatever broke it
            self.post(Fatal(ProtocolError("runtime_dead", f"runtime stream ended: {exc}")))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.gw.settings.tick_interval_s)
            self.post(Tick())

    # ---- cleanup: the admission slot stays held until it succeeds (AD-3) ---------------------------------
    async def cleanup(self) -> str | None:
        """The close path's cleanup through admission: None when the slot was freed, else why not."""
        ok = await self.gw.admission.close(self.session_id, self._cleanup_once)
        return None if ok else (self._cleanup_error or "runtime close timed out")

    async def _cleanup_once(self) -> None:
        session = self.session
        assert session is not None
        self._cleanup_error = None
        try:
            if not self._drained:  # X1/X4: the runtime close never overtakes appends admitted before it
                await session.lane.drain()
                self._drained = True
            await self.gw.runtime.close(session.key, session.fence)
        except RuntimeFailure as exc:
            if exc.code != "session_not_found":
                self._cleanup_error = f"runtime close failed: {exc}"
                raise
            # The runtime holds nothing for this session any more (its own idle expiry, or an earlier attempt
            # already removed the stream): the close is done, and the slot must not wait for it forever.
        except Exception as exc:
            self._cleanup_error = f"runtime close failed: {exc}"
            raise
        gw, sid = self.gw, session.session_id
        gw.registry.release(sid)
        gw.leases.remove(sid)
        if gw.sessions.get(sid) is self:
            del gw.sessions[sid]

    # ---- writer hooks ----------------------------------------------------------------------------------
    def _resync_frame(self, last_seq: int) -> str:
        ev = resync_required_event(self.session_id, "journal_overflow", last_seq)
        return self.writer.serialise(ev, None)

    def _after_send(self, ev: Json) -> None:
        if ev["type"] == "session.created":
            self.attachments.created_delivered = True
        self.meters.sent(ev)

    def created_json(self) -> dict[str, Any]:
        assert self.session is not None
        return self.session.session_json()


def replay_texts(plan_replay: tuple[bytes, ...]) -> list[str]:
    """J-6: the journaled bytes, sent as the same text (never re-projected)."""
    return [b.decode("utf-8") for b in plan_replay]

