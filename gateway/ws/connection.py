"""One WebSocket connection: handshake (open or resume), then a receive loop feeding a `LiveSession`.

The session (inbox, actor, outbox, writer, journal) lives in `gateway.ws.live` and outlives this socket;
this class only lends the socket to the session's writer and tags every inbound frame with its
attachment generation (§1.3), until the socket is gone, replaced or the session closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.directory.relay import relayed_to_owner
from gateway.protocol import client_events as ce
from gateway.protocol.codec import FrameLimits, decode_frame
from gateway.protocol.errors import Effect, ProtocolError
from gateway.protocol.profiles import Profile, Projector
from gateway.resume.journal import Journal, JournalConfig, Sequencer
from gateway.session.outbox import Outbox, OutboxLimits, OutItem
from gateway.state import GatewayState
from gateway.ws import faults
from gateway.ws.actor import run_actor
from gateway.ws.handshake import ConnectionParams
from gateway.ws.live import LiveSession
from gateway.ws.messages import Admitted, ConnState, Disconnected, Rejected
from gateway.ws.opening import open_session, read_opener
from gateway.ws.resuming import resume_session
from gateway.ws.writer import Writer

log = logging.getLogger(__name__)


class Connection:
    def __init__(self, ws: WebSocket, params: ConnectionParams | None, state: GatewayState) -> None:
        self.ws, self.params, self.gw = ws, params, state
        self.state = ConnState.CONNECTING
        self.limits = FrameLimits(state.settings.max_frame_bytes)
        self.live: LiveSession | None = None
        self.resuming = False

    def profile(self, params_error: ProtocolError | None) -> Profile:
        if self.params is None:
            return Profile.GA
        if params_error is None and self.params.route == "/v1/duplex":
            return Profile.NATIVE
        return self.params.profile

    async def serve(self, params_error: ProtocolError | None) -> None:
        await self.ws.accept(subprotocol=self.params.subprotocol if self.params else None)
        self.state = ConnState.HANDSHAKE
        profile = self.profile(params_error)
        if params_error is not None:
            await self.refuse(params_error, profile)
            return
        try:
            generation = await self._handshake()
        except ProtocolError as err:
            await self.refuse(err, profile)
            return
        except Exception as exc:  # noqa: BLE001 - a gateway fault during the handshake: 1011, nothing kept
            err = faults.internal(exc)
            err.effect = Effect.HANDSHAKE
            await self.refuse(err, profile)
            return
        if generation is None:
            self.state = ConnState.CLOSED
            return  # already answered and closed: a journal gap at resume (resync_required, J-5), or a relay
        self.state = ConnState.OPEN
        await self._attached(generation)
        self.state = ConnState.CLOSED

    def handshake_writer(self, profile: Profile) -> tuple[Writer, Outbox]:
        """A one-shot writer for handshake answers (nothing is sequenced or retained)."""
        s = self.gw.settings
        outbox = Outbox(OutboxLimits(s.outbound_max_bytes, s.outbound_max_events, s.outbound_reserve_bytes,
                                     s.outbound_reserve_events))
        journal = Journal(JournalConfig(s.resume_replay_ttl_s, s.resume_replay_max_bytes_per_session))
        writer = Writer(outbox, Projector(profile), Sequencer(journal, lambda last: "{}"))
        writer.attach(self.ws, 0)
        return writer, outbox

    async def send_and_close(self, item: OutItem, profile: Profile) -> None:
        writer, outbox = self.handshake_writer(profile)
        outbox.put(item, reserved=True)
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await writer.run()

    async def refuse(self, err: ProtocolError, profile: Profile) -> None:
        self.gw.metrics.admission_refused(err.code)
        if self.resuming:
            self.gw.metrics.resume_result(err.code)
        await self.send_and_close(faults.handshake_failure(err, err.client_event_id), profile)
        self.state = ConnState.CLOSED

    async def _handshake(self) -> int | None:
        """Readiness, the opening frame and the open transaction (H2-H6), or the resume procedure (§6.4).
        Returns the attachment generation of this socket (None: already answered and closed)."""
        ready, _, _ = await self.gw.readiness()
        if not ready:
            raise ProtocolError("runtime_unavailable", "runtime not ready", effect=Effect.HANDSHAKE)
        params = self.params
        assert params is not None
        opener, patch = None, None
        if not params.autostart:
            opener, patch = await read_opener(self._next_text, params, self.limits,
                                              self.gw.settings.handshake_timeout_s)
        if isinstance(opener, ce.SessionResume):
            self.resuming = True
            if await relayed_to_owner(self.gw, self.ws, patch):
                return None  # another gateway owns the session: it answered through the relay (gateway/directory)
            live, generation = await resume_session(self.gw, params, self.ws, patch,
                                                    send_and_close=self.send_and_close)
            self.live = live
            return generation
        live = LiveSession(self.gw, params)
        session = await open_session(self.gw, params, patch, live.outbox, live.post_lane)
        self.live = live
        return live.start(session, self.ws, echo_update=isinstance(opener, ce.SessionUpdate), actor=run_actor)

    async def _next_text(self) -> str:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise ProtocolError("session_created_undelivered", "socket closed during the handshake")
            if msg.get("text") is not None:
                return msg["text"]
            self.gw.metrics.ignored_binary.inc()

    async def _attached(self, generation: int) -> None:
        """Receive until the socket closes, or the session releases it (closed, replaced)."""
        live = self.live
        assert live is not None
        released = live.released.get(generation)
        receive = asyncio.ensure_future(self._receive(live, generation))
        waiters = {receive} | ({asyncio.ensure_future(released.wait())} if released is not None else set())
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waiters:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    async def _receive(self, live: LiveSession, generation: int) -> None:
        """Admission: decode + normalise aliases, then enqueue in arrival order (exactly once)."""
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    live.post(Disconnected("disconnect", generation))
                    return
                if msg.get("text") is None:
                    self.gw.metrics.ignored_binary.inc()  # §1.3: binary frames are ignored
                    continue
                try:
                    ev, raw = decode_frame(msg["text"], self.limits)
                except ProtocolError as err:
                    live.post(Rejected(err, generation))
                    continue
                except Exception as exc:  # noqa: BLE001 - a decoder fault must cost one frame, not the socket
                    live.post(Rejected(faults.internal(exc), generation))
                    continue
                live.post(Admitted(ev, raw, generation))
        except (WebSocketDisconnect, RuntimeError, OSError):
            live.post(Disconnected("transport_error", generation))
