"""`DuplexSession`: the aggregate root. `handle` is the single entry for admitted client events.

The session is thin: it holds the shared context (`SessionCore`: identity, config, state, outbox) and
routes each event to the part that owns the state it changes — `InputTrack` (input items, units, commits,
VAD), `ResponseTrack` (responses, epoch, playback, history; runtime output) and `ResponseCommands`. Calls
the response track makes to the input side (`InputLink`) are routed here too, so no part subclasses
another. The session actor (gateway.ws.actor) calls `handle`, `on_runtime`, `on_lane` and `on_tick` one at
a time; nothing else mutates the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from gateway.protocol import client_events as ce
from gateway.protocol import server_events as se
from gateway.protocol.codec import decode_object
from gateway.protocol.config import ConfigContext, SessionConfig, apply_patch, response_options
from gateway.protocol.errors import ProtocolError
from gateway.runtime.base import Fence, Runtime, RuntimeEvent, RuntimeFailure, SessionKey, map_runtime_code
from gateway.session import runtime_config as rc
from gateway.session import view
from gateway.session.commands import ADVISORY_SIGNALS, REDISPATCHED_SIGNALS, ResponseCommands
from gateway.session.core import SessionCore, SessionLimits
from gateway.session.inputs import InputTrack
from gateway.session.lane import LaneResult, RuntimeLane
from gateway.session.outbox import Kind, Outbox, OutItem
from gateway.session.response_track import ResponseTrack
from gateway.session.units import MODEL_RATE_HZ, UnitGeometry
from gateway.vad.batcher import VadBatcher
from gateway.vad.overlap import OverlapChunk, client_action

Json = dict[str, Any]
Cleanup = Callable[[], Awaitable[str | None]]


class DuplexSession(SessionCore):
    def __init__(self, *, session_id: str, incarnation: int, config: SessionConfig, ctx: ConfigContext,
                 limits: SessionLimits, runtime: Runtime, key: SessionKey, outbox: Outbox,
                 post_lane: Callable[[LaneResult], None], clock: Callable[[], float], geometry: UnitGeometry,
                 runtime_defaults: rc.RuntimeDefaults, capabilities: Json, limits_json: Json) -> None:
        lane = RuntimeLane(runtime, key, lambda: self.fence, post_lane, limits.max_pending_input_bytes,
                           limits.runtime_timeout_s)
        super().__init__(session_id=session_id, incarnation=incarnation, config=config, ctx=ctx, limits=limits,
                         runtime=runtime, key=key, outbox=outbox, lane=lane,
                         runtime_config=rc.derive(config, runtime_defaults), clock=clock)
        self.runtime_defaults = runtime_defaults
        self.capabilities, self.limits_json = capabilities, limits_json
        self.responses = ResponseTrack(self, link=self)
        self.inputs = InputTrack(self, self.responses, geometry)
        self.commands = ResponseCommands(self, self.responses)

    # ---- views -------------------------------------------------------------------------------------------
    @property
    def fence(self) -> Fence:
        return Fence(self.incarnation, self.responses.epoch)

    def is_stale(self, item: OutItem) -> bool:
        return self.responses.is_stale(item)

    def session_json(self) -> Json:
        return view.session_object(self, self.responses, self.inputs, self.capabilities, self.limits_json)

    def bind_host(self, seq_source: Callable[[], int], vad: Callable[[], VadBatcher] | None,
                  vad_onset_confirm_ms: int) -> None:
        """H6: the writer's sequence and the process's VAD (model and batcher), then the detector for
        `turn_detection`."""
        self.bind_seq_source(seq_source)
        self.inputs.vad.bind(vad, vad_onset_confirm_ms)
        self.inputs.sync_vad()

    # ---- InputLink: what the response track asks of the input side ---------------------------------------
    @property
    def promoted_commit_pending(self) -> bool:
        return self.inputs.promoted_commit_pending

    def response_input_item(self) -> str | None:
        return self.inputs.response_input_item()

    def consume_committed_input(self) -> None:
        self.inputs.consume_committed_input()

    def after_terminal(self) -> None:
        self.inputs.after_terminal()

    def on_response_opened(self) -> None:
        self.inputs.on_response_opened()

    def on_unit_decided(self, unit: int) -> None:
        self.inputs.on_unit_decided(unit)

    def force_next_unit_listen(self) -> None:
        self.inputs.force_next_unit_listen()

    # ---- events from the actor -----------------------------------------------------------------------------
    def on_runtime(self, ev: RuntimeEvent) -> None:
        self.responses.on_runtime(ev)

    def on_lane(self, result: LaneResult) -> None:
        self.inputs.on_lane(result)

    def on_tick(self, now: float) -> None:
        self.inputs.on_tick(now)

    def fail_or_report(self, err: ProtocolError) -> None:
        self.responses.fail_or_report(err)

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
                await self.append(ev)
            case ce.InputAudioBufferCommit():
                self.inputs.commit(ev)
            case ce.InputAudioBufferClear():
                self.inputs.input_clear()
            case ce.InputCancel():
                self.inputs.input_cancel()
            case ce.ResponseCreate():
                self.response_create(ev)
            case ce.ResponseCancel():
                self.commands.response_cancel(ev)
            case ce.OutputAudioBufferClear():
                self.commands.output_clear()
            case ce.BargeIn():
                self.commands.barge_in()
            case ce.PlaybackAck():
                self.commands.playback_ack(ev)
            case ce.ConversationItemCreate():
                await self.inputs.item_create(ev)
            case ce.ConversationItemRetrieve():
                self.commands.item_retrieve(ev)
            case ce.ConversationItemDelete():
                self.commands.item_delete(ev)
            case ce.ConversationItemTruncate():
                self.commands.item_truncate(ev)
            case ce.SessionUpdate():
                await self.update(ev)
            case ce.SessionEventAck():
                self.commands.event_ack(ev)
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

    def turn_state(self) -> str:
        return view.turn_state(self.responses, self.inputs, self.clock())

    # ---- commands that need both tracks ------------------------------------------------------------------
    async def append(self, ev: ce.InputAudioBufferAppend) -> None:
        """§8.3: while the assistant generates or plays, an append is an overlap chunk first."""
        inputs = self.inputs
        prep = await inputs.prepare_audio(ev)
        state = self.turn_state()
        if state not in ("assistant_generating", "assistant_playing"):
            inputs.overlap.end()
            inputs.accept_audio(prep, force_listen=ev.force_listen, final=ev.final)
            return
        cfg = self.config
        client = client_action(ev.overlap_action, ev.force_barge_in)
        d = inputs.overlap.decide(OverlapChunk(prep.is_speech, len(prep.samples16k) * 1000 / MODEL_RATE_HZ,
                                               vad_on=inputs.vad.stream is not None,
                                               onset_confirmed=prep.vad is not None and prep.vad.onset_confirmed,
                                               client_action=client, auto_response=cfg.effective_auto_response),
                                  policy=cfg.effective_overlap_policy, short_ack_ms=cfg.overlap_short_ack_ms,
                                  barge_in_ms=cfg.overlap_barge_in_ms)
        playing = self.responses.active or self.responses.last_audio()
        decision = d.event(session_id=self.session_id, epoch=self.responses.epoch,
                           response_id=playing.id if playing else None, policy=cfg.effective_overlap_policy,
                           force_listen=ev.force_listen)
        if d.barge_in:
            inputs.overlap.end()
            self.commands.overlap_barge_in(decision, "barge_in" if d.reason == "client_overlap_action"
                                           else "turn_detected")
        elif d.emit:
            self.emit(decision)
        if d.action == "drop":  # silence of equal length keeps the model clock continuous
            prep = dataclasses.replace(prep, samples16k=np.zeros_like(prep.samples16k), is_speech=False)
        inputs.accept_audio(prep, force_listen=ev.force_listen, final=ev.final, keep=d.action != "drop")

    def response_create(self, ev: ce.ResponseCreate) -> None:
        opts = response_options(ev.response, self.config)
        if self.responses.active is not None:
            raise ProtocolError("response_already_active", "a response is already active")
        if not self.inputs.has_unconsumed_input():
            raise ProtocolError("response_create_without_input", "no unconsumed committed input")
        self.responses.open_response("response_create", opts, precreated=True,
                                     input_item_id=self.inputs.response_input_item())

    async def turn_signal(self, ev: ce.TurnSignal) -> None:
        if ev.event in REDISPATCHED_SIGNALS:
            inner, _ = decode_object({**ev.payload, "type": ev.event})
            await self.handle(inner)
        elif ev.event in ADVISORY_SIGNALS:
            self.emit(se.TurnEvent(session_id=self.session_id, epoch=self.responses.epoch, event=ev.event,
                                   turn_state=self.turn_state()).model_dump())
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
        runtime_updated = cand_rc != self.runtime_config
        if runtime_updated:
            try:
                async with asyncio.timeout(self.limits.runtime_timeout_s):
                    await self.runtime.update(self.key, self.fence, cand_rc)
            except RuntimeFailure as exc:
                raise ProtocolError(map_runtime_code("update", exc.code), exc.message or exc.code) from None
            except TimeoutError:
                raise ProtocolError("runtime_timeout", "runtime update timed out") from None
        self.apply_config(candidate, cand_rc, runtime_updated=runtime_updated)
        self.inputs.on_config(candidate, touched)
        self.emit(se.SessionUpdated(session=self.session_json()).model_dump())

    async def close(self, reason: str, client_reason: str | None = None, *, from_client: bool = False,
                    expired: bool = False, cleanup: Cleanup) -> bool:
        """X2-X5: cancel, cleanup (lane drain + runtime close, bounded, owned by admission), then
        `session.closed` (or `session.expired`, whose reason is the expiry reason). `cleanup()` returns None
        on success, else why it failed (the slot stays held and the reaper retries, AD-3).
        Returns whether cleanup is pending."""
        if self.state != "open":
            return False
        self.inputs.drop_deferred()
        self.set_state("closing")  # X4 before the cancel so no deferred commit is promoted by its terminal
        why = "session_expired" if expired else ("client_session_close" if from_client else "session_close")
        self.responses.close_active(why)
        self.responses.finalise_history()
        # X4: input not yet sent to the runtime is dropped, as nothing of this session is sent after the close
        # (the cleanup's drain waited behind it: a backlog of input sent faster than real time outlasted
        # close_ack_timeout_s and showed as runtime_close_failed)
        self.lane.drop_queued()
        failure = await cleanup()
        if failure is not None:
            with contextlib.suppress(ProtocolError):
                self.emit_error(ProtocolError("runtime_close_failed", failure))
        await self.lane.aclose()
        self.set_state("closed")
        last = (se.SessionExpired(session_id=self.session_id, epoch=self.responses.epoch, reason=reason) if expired else
                se.SessionClosed(session_id=self.session_id, epoch=self.responses.epoch, reason=reason,
                                 client_reason=client_reason, cleanup_pending=failure is not None))
        with contextlib.suppress(ProtocolError):
            self.emit(last.model_dump(), reserved=True)
        return failure is not None
