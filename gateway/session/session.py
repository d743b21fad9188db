"""`DuplexSession`: the aggregate root. `handle` is the single entry for admitted client events.

The session actor (gateway.ws.actor) calls `handle`, `on_runtime`, `on_lane` and `on_tick` one at a
time; nothing else mutates the session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.protocol import client_events as ce
from gateway.protocol import server_events as se
from gateway.protocol.codec import decode_object
from gateway.protocol.config import ConfigContext, SessionConfig, apply_patch
from gateway.protocol.errors import ProtocolError
from gateway.runtime.base import Runtime, RuntimeFailure, SessionKey, map_runtime_code
from gateway.session import runtime_config as rc
from gateway.session.commands import ADVISORY_SIGNALS, REDISPATCHED_SIGNALS, CommandsMixin
from gateway.session.core import SessionLimits
from gateway.session.lane import LaneResult, RuntimeLane
from gateway.session.outbox import Kind, Outbox
from gateway.session.units import UnitCutter, UnitGeometry
from gateway.session.view import session_object, turn_state

Json = dict[str, Any]
Cleanup = Callable[[], Awaitable[str | None]]


class DuplexSession(CommandsMixin):
    def __init__(self, *, session_id: str, incarnation: int, config: SessionConfig, ctx: ConfigContext,
                 limits: SessionLimits, runtime: Runtime, key: SessionKey, outbox: Outbox,
                 post_lane: Callable[[LaneResult], None], clock: Callable[[], float], geometry: UnitGeometry,
                 runtime_defaults: rc.RuntimeDefaults, capabilities: Json, limits_json: Json) -> None:
        lane = RuntimeLane(runtime, key, lambda: self.fence, post_lane, limits.max_pending_input_bytes,
                           limits.runtime_timeout_s)
        super().__init__(session_id=session_id, incarnation=incarnation, config=config, ctx=ctx, limits=limits,
                         runtime=runtime, key=key, outbox=outbox, lane=lane, cutter=UnitCutter(geometry),
                         runtime_config=rc.derive(config, runtime_defaults), clock=clock)
        self.runtime_defaults = runtime_defaults
        self.capabilities, self.limits_json = capabilities, limits_json
        self.init_input()

    def session_json(self) -> Json:
        return session_object(self, self.capabilities, self.limits_json)

    async def open(self) -> None:
        """H5 runtime open with epoch 0; raises ProtocolError(runtime_open_failed) after rolling back."""
        try:
            async with asyncio.timeout(self.limits.runtime_timeout_s):
                await self.runtime.open(self.key, self.fence, self.runtime_config)
        except (RuntimeFailure, TimeoutError) as exc:
            raise ProtocolError("runtime_open_failed", f"runtime open failed: {exc}") from None
        self.lane.start()

    async def handle(self, ev: ce.ClientEvent) -> None:
        """Apply one admitted event; raises ProtocolError for a frame-level rejection."""
        match ev:
            case ce.InputAudioBufferAppend():
                self.append(ev)
            case ce.InputAudioBufferCommit():
                self.commit(ev)
            case ce.InputAudioBufferClear():
                self.input_clear()
            case ce.InputCancel():
                self.input_cancel()
            case ce.ResponseCreate():
                self.response_create(ev)
            case ce.ResponseCancel():
                self.response_cancel(ev)
            case ce.OutputAudioBufferClear():
                self.output_clear()
            case ce.BargeIn():
                self.barge_in()
            case ce.PlaybackAck():
                self.playback_ack(ev)
            case ce.ConversationItemCreate():
                self.item_create(ev)
            case ce.ConversationItemRetrieve():
                self.item_retrieve(ev)
            case ce.ConversationItemDelete():
                self.item_delete(ev)
            case ce.ConversationItemTruncate():
                self.item_truncate(ev)
            case ce.SessionUpdate():
                await self.update(ev)
            case ce.SessionEventAck():
                self.event_ack(ev)
            case ce.SessionHeartbeat():
                self.emit(se.HeartbeatAck(session_id=self.session_id,
                                          lease_expires_in_s=self.config.idle_timeout_s).model_dump(),
                          kind=Kind.UNSEQUENCED)
            case ce.TurnSignal():
                await self.turn_signal(ev)
            case ce.InputTextAppend():
                raise ProtocolError("native_text_append_unsupported", "text input is not supported; use "
                                    "extra_body.duplex_initial_user_text")
            case ce.SessionCreate():
                raise ProtocolError("bad_event", "session.create is only valid as the opening frame", param="type")
            case ce.SessionResume():
                raise ProtocolError("unsupported_session_resume", "session.resume after the handshake")
            case ce.SessionClose():
                raise AssertionError("session.close is handled by the actor")

    async def turn_signal(self, ev: ce.TurnSignal) -> None:
        if ev.event in REDISPATCHED_SIGNALS:
            inner, _ = decode_object({**ev.payload, "type": ev.event})
            await self.handle(inner)
        elif ev.event in ADVISORY_SIGNALS:
            self.emit(se.TurnEvent(session_id=self.session_id, epoch=self.epoch, event=ev.event,
                                   turn_state=turn_state(self)).model_dump())
        else:
            raise ProtocolError("bad_event", f"unknown turn signal {ev.event!r}", param="event")

    async def update(self, ev: ce.SessionUpdate) -> None:
        """Transactional update (§2.7 U1-U7): validate, wait for the append tail, runtime ACK, swap."""
        apply_patch(self.config, ev.session, self.ctx, opening=False, prefix_committed=self.prefix_committed)
        try:
            async with asyncio.timeout(self.limits.runtime_timeout_s):
                await self.lane.drain()
        except TimeoutError:
            raise ProtocolError("runtime_timeout", "earlier appends did not complete") from None
        # Re-validate: the tail may have completed the prefix commit meanwhile (§2.6).
        candidate, touched = apply_patch(self.config, ev.session, self.ctx, opening=False,
                                         prefix_committed=self.prefix_committed)
        cand_rc = rc.derive(candidate, self.runtime_defaults)
        if cand_rc != self.runtime_config:
            try:
                async with asyncio.timeout(self.limits.runtime_timeout_s):
                    await self.runtime.update(self.key, self.fence, cand_rc)
            except RuntimeFailure as exc:
                raise ProtocolError(map_runtime_code("update", exc.code), exc.message or exc.code) from None
            except TimeoutError:
                raise ProtocolError("runtime_timeout", "runtime update timed out") from None
            self.config_generation += 1
        self.config, self.runtime_config = candidate, cand_rc
        if "force_listen_count" in touched:
            self._force_listen_remaining = candidate.force_listen_count
        if "duplex_initial_user_text" in touched:
            self._initial_text_pending = candidate.duplex_initial_user_text is not None
        if "turn_detection" in touched:
            self.sync_vad()
        self.emit(se.SessionUpdated(session=self.session_json()).model_dump())

    def item_create(self, ev: ce.ConversationItemCreate) -> None:
        item = ev.item
        content = item.get("content") if isinstance(item, dict) else None
        parts = content if isinstance(content, list) else []
        if any(isinstance(p, dict) and p.get("type") == "input_text" for p in parts):
            raise ProtocolError("native_text_append_unsupported", "user text items are not supported",
                                param="item.content")
        if (item.get("type", "message") != "message" or item.get("role") != "user" or len(parts) != 1
                or not isinstance(parts[0], dict) or parts[0].get("type") != "input_audio"
                or not isinstance(parts[0].get("audio"), str)):
            raise ProtocolError("unsupported_item_type", "only a user message with one input_audio part",
                                param="item")
        if self._item_id is not None and self._item_has_audio:
            raise ProtocolError("bad_event", "an input item is open; commit or clear it first", param="item")
        if ev.previous_item_id is not None and ev.previous_item_id != self._history.last_id:
            raise ProtocolError("bad_event", "previous_item_id must be the last item", param="previous_item_id")
        part = parts[0]
        append = ce.InputAudioBufferAppend(type="input_audio_buffer.append", audio=part["audio"],
                                           format=part.get("format"), sample_rate_hz=part.get("sample_rate_hz"))
        prep = self.prepare_audio(append)
        if not len(prep.samples16k):
            raise ProtocolError("input_audio_buffer_empty", "the item holds no audio", param="item.content[0]")
        if self._pending_turns >= self.limits.max_pending_turns:
            raise ProtocolError("input_backpressure", "too many pending commits")
        self.accept_audio(prep, force_listen=False, final=False)
        self.commit(ce.InputAudioBufferCommit(type="input_audio_buffer.commit"))

    async def close(self, reason: str, client_reason: str | None = None, *, from_client: bool = False,
                    expired: bool = False, cleanup: Cleanup) -> bool:
        """X2-X5: cancel, cleanup (lane drain + runtime close, bounded, owned by admission), then
        `session.closed` (or `session.expired`, whose reason is the expiry reason). `cleanup()` returns None
        on success, else why it failed (the slot stays held and the reaper retries, AD-3).
        Returns whether cleanup is pending."""
        if self.state != "open":
            return False
        self._deferred_item = None
        self.state = "closing"  # X4 before the cancel so no deferred commit is promoted by its terminal
        if self._active is not None:
            self.kill_stream(self._active)
            # At close the runtime close replaces the cancel (K0), so the epoch is not advanced here.
            with contextlib.suppress(ProtocolError):  # a full outbound queue must not stop the cleanup
                why = "session_expired" if expired else ("client_session_close" if from_client else "session_close")
                self.finish(self._active, "cancelled", why)
        self.finalise_history()
        # X4: input not yet sent to the runtime is dropped, as nothing of this session is sent after the close
        # (the cleanup's drain waited behind it: a backlog of input sent faster than real time outlasted
        # close_ack_timeout_s and showed as runtime_close_failed)
        self.lane.drop_queued()
        failure = await cleanup()
        if failure is not None:
            with contextlib.suppress(ProtocolError):
                self.emit_error(ProtocolError("runtime_close_failed", failure))
        await self.lane.aclose()
        self.state = "closed"
        last = (se.SessionExpired(session_id=self.session_id, epoch=self.epoch, reason=reason) if expired else
                se.SessionClosed(session_id=self.session_id, epoch=self.epoch, reason=reason,
                                 client_reason=client_reason, cleanup_pending=failure is not None))
        with contextlib.suppress(ProtocolError):
            self.emit(last.model_dump(), reserved=True)
        return failure is not None

    def finalise_history(self) -> None:
        """At close: nothing more will be played, so the history commit of the last response is final."""
        for resp in self._responses.values():
            entry = resp.playback
            if entry is None or entry.history_final or not resp.terminal:
                continue
            entry.history_final = True  # §7.3: truncate or close finalises the entry where it stands
