"""One WebSocket connection: explicit states, one task group, one mailbox, one actor, one writer.

receive loop  --Admitted/Rejected-->  inbox  <--RuntimeOut-- runtime pump
                                        ^  <--LaneOut------ lane results, Tick -- ticker
                                        |
                                      actor (applies each message exactly once, in arrival order)
                                        |
                                      outbox --> writer (the only sender)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.protocol import client_events as ce
from gateway.protocol.codec import FrameLimits, decode_frame
from gateway.protocol.errors import Effect, ProtocolError
from gateway.protocol.profiles import Projector
from gateway.session.outbox import Kind, Outbox, OutboxLimits, OutItem
from gateway.session.session import DuplexSession
from gateway.session.view import session_object
from gateway.state import GatewayState
from gateway.ws import faults
from gateway.ws.handshake import ConnectionParams
from gateway.ws.messages import (
    ALLOWED,
    Admitted,
    ConnState,
    Disconnected,
    Fatal,
    LaneOut,
    Message,
    Rejected,
    RuntimeOut,
    Tick,
)
from gateway.ws.opening import open_session, read_opener
from gateway.ws.writer import Writer

log = logging.getLogger(__name__)


class Connection:
    def __init__(self, ws: WebSocket, params: ConnectionParams | None, state: GatewayState) -> None:
        s = state.settings
        self.ws, self.params, self.gw = ws, params, state
        self.state = ConnState.CONNECTING
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.outbox = Outbox(OutboxLimits(s.outbound_max_bytes, s.outbound_max_events, s.outbound_reserve_bytes,
                                          s.outbound_reserve_events))
        self.limits = FrameLimits(s.max_frame_bytes)
        self.session: DuplexSession | None = None
        self.writer: Writer | None = None
        self._end_reason = ""

    def _to(self, new: ConnState) -> None:
        if new not in ALLOWED[self.state]:
            raise RuntimeError(f"illegal connection transition {self.state} -> {new}")
        self.state = new

    def _on_drop(self, event_type: str) -> None:
        c = self.gw.counters.stale_dropped
        c[event_type] = c.get(event_type, 0) + 1

    async def serve(self, params_error: ProtocolError | None) -> None:
        await self.ws.accept(subprotocol=self.params.subprotocol if self.params else None)
        self._to(ConnState.HANDSHAKE)
        from gateway.protocol.profiles import Profile  # noqa: PLC0415 - the ga default for param errors

        profile = self.params.profile if self.params else Profile.GA
        if params_error is None and self.params and self.params.route == "/v1/duplex":
            profile = Profile.NATIVE
        self.writer = Writer(self.ws, self.outbox, Projector(profile), on_drop=self._on_drop)
        async with asyncio.TaskGroup() as tg:
            writer = tg.create_task(self._write(), name="writer")
            if params_error is not None:
                await self._refuse(params_error, writer)
                return
            try:
                opener = await self._handshake()
            except ProtocolError as err:
                await self._refuse(err, writer)
                return
            except Exception as exc:  # noqa: BLE001 - a gateway fault during the handshake: 1011, nothing kept
                err = faults.internal(exc)
                err.effect = Effect.HANDSHAKE
                await self._refuse(err, writer)
                return
            self._to(ConnState.OPEN)
            aux = [tg.create_task(self._receive(), name="receive"),
                   tg.create_task(self._pump_runtime(), name="runtime-pump"),
                   tg.create_task(self._tick(), name="ticker")]
            if isinstance(opener, ce.SessionUpdate):
                await self._admit_update_echo()
            await self._actor()
            for t in aux:
                t.cancel()
            end = faults.SESSION_EXPIRED if self._end_reason == "idle_ttl_expired" else faults.SESSION_CLOSED
            self.outbox.put(OutItem(events=(), kind=Kind.UNSEQUENCED, close=end), reserved=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.gw.settings.close_ack_timeout_s):
                    await asyncio.shield(writer)
            writer.cancel()
        self._to(ConnState.CLOSED)

    async def _write(self) -> None:
        assert self.writer is not None
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await self.writer.run()

    async def _refuse(self, err: ProtocolError, writer: asyncio.Task[None]) -> None:
        self.gw.counters.admission_rejected[err.code] = self.gw.counters.admission_rejected.get(err.code, 0) + 1
        self.outbox.put(faults.handshake_failure(err, err.client_event_id), reserved=True)
        await writer
        self._to(ConnState.CLOSED)

    async def _handshake(self) -> ce.ClientEvent | None:
        """H2-H6. Returns the opener event (None for autostart)."""
        ready, _, _ = await self.gw.readiness()
        if not ready:
            raise ProtocolError("runtime_unavailable", "runtime not ready", effect=Effect.HANDSHAKE)
        assert self.params is not None
        opener, patch = None, None
        if not self.params.autostart:
            opener, patch = await read_opener(self._next_text, self.params, self.limits,
                                              self.gw.settings.handshake_timeout_s)
        self.session = await open_session(self.gw, self.params, patch, self.outbox,
                                          lambda r: self.inbox.put_nowait(LaneOut(r)))
        assert self.writer is not None
        self.session.seq_source = self.writer.last_seq
        self.writer.is_stale = self.session.is_stale
        self.outbox.put(OutItem(events=(self._created(),), kind=Kind.UNSEQUENCED))
        return opener

    def _created(self) -> dict[str, Any]:
        s = self.session
        assert s is not None
        return {"type": "session.created", "session": session_object(s, s.capabilities, s.limits_json),
                "incarnation": s.incarnation, "attachment_generation": 1}

    async def _admit_update_echo(self) -> None:
        assert self.session is not None
        self.session.emit({"type": "session.updated", "session": self.session.session_json()})

    async def _next_text(self) -> str:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise ProtocolError("session_created_undelivered", "socket closed during the handshake")
            if msg.get("text") is not None:
                return msg["text"]
            self.gw.counters.ignored_binary_frames += 1

    async def _receive(self) -> None:
        """Admission: decode + normalise aliases, then enqueue in arrival order (exactly once)."""
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    self.inbox.put_nowait(Disconnected("disconnect"))
                    return
                if msg.get("text") is None:
                    self.gw.counters.ignored_binary_frames += 1  # §1.3: binary frames are ignored
                    continue
                try:
                    ev, raw = decode_frame(msg["text"], self.limits)
                except ProtocolError as err:
                    self.inbox.put_nowait(Rejected(err))
                    continue
                self.inbox.put_nowait(Admitted(ev, raw))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.inbox.put_nowait(Disconnected("transport_error"))

    async def _pump_runtime(self) -> None:
        assert self.session is not None
        try:
            async for ev in self.gw.runtime.events(self.session.key):
                self.inbox.put_nowait(RuntimeOut(ev))
            if self.session.state == "open":
                self.inbox.put_nowait(Fatal(ProtocolError("runtime_dead", "runtime stream ended")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the binding is gone whatever broke it
            self.inbox.put_nowait(Fatal(ProtocolError("runtime_dead", f"runtime stream ended: {exc}")))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.gw.settings.tick_interval_s)
            self.inbox.put_nowait(Tick())

    async def _actor(self) -> None:
        """The session actor: applies every message exactly once, in arrival order, then closes."""
        session = self.session
        assert session is not None
        reason, client_reason, from_client = "disconnect", None, False
        while True:
            msg = await self.inbox.get()
            try:
                if isinstance(msg, Admitted):
                    if isinstance(msg.event, ce.SessionClose):
                        reason, client_reason, from_client = "client_close", msg.event.reason, True
                        break
                    try:
                        await session.handle(msg.event)
                    except ProtocolError as err:
                        err.client_event_id = msg.event.event_id
                        if self._apply_error(err):
                            reason = faults.close_reason(err)
                            break
                elif isinstance(msg, Rejected):
                    self.outbox.put(faults.rejected_frame(msg.error, msg.error.client_event_id), reserved=True)
                elif isinstance(msg, RuntimeOut):
                    session.on_runtime(msg.event)
                elif isinstance(msg, LaneOut):
                    session.on_lane(msg.result)
                elif isinstance(msg, Tick):
                    now = time.monotonic()
                    if session.idle_expired(now):
                        reason = "idle_ttl_expired"
                        break
                    session.on_tick(now)
                elif isinstance(msg, Fatal):
                    self._apply_error(msg.error)
                    reason = faults.close_reason(msg.error)
                    break
                elif isinstance(msg, Disconnected):
                    reason = msg.reason
                    break
            except ProtocolError as err:
                if self._apply_error(err):
                    reason = faults.close_reason(err)
                    break
            except Exception as exc:  # noqa: BLE001 - mapped to internal_error, session closed
                self._apply_error(faults.internal(exc))
                reason = "internal_error"
                break
        self._to(ConnState.CLOSING)
        self._end_reason = reason
        self.gw.counters.sessions_ended[reason] = self.gw.counters.sessions_ended.get(reason, 0) + 1
        try:
            await session.close(reason, client_reason, from_client=from_client,
                                expired=reason == "idle_ttl_expired")
        finally:
            self.gw.registry.release(session.session_id)

    def _apply_error(self, err: ProtocolError) -> bool:
        """Route one error by its effect (§1.7). Returns True when the session must close."""
        session = self.session
        assert session is not None
        try:
            if err.effect is Effect.REJECT_FRAME or err.effect is Effect.HANDSHAKE:
                self.outbox.put(faults.rejected_frame(err, err.client_event_id), reserved=True)
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
