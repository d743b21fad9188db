"""Per-session observers feeding the process metrics (protocol.md §10.4); labels never carry client strings.

Gateway-clock latencies: unit submitted -> decision, speaking unit decided -> its first audio from the runtime,
response.created / commit -> first audio delta written, the gap between audio deltas, cancel accepted ->
response.done written. Everything else is counted from what really reached a socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.observability import GatewayMetrics
from gateway.runtime.base import AudioPiece, Decision, RuntimeEvent

Json = dict[str, Any]
MS_PER_S = 1000.0
BARGE_IN_SOURCES = {"client_overlap_action": "client", "server_vad_utterance_active": "vad"}


class SessionMeters:
    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.m, self._clock = metrics, clock
        self._submitted: dict[int, float] = {}  # unit index -> submit time
        self._speaking: dict[int, float] = {}  # unit index -> decision time, until its first audio
        self._created_at: dict[str, float] = {}
        self._last_audio_at: dict[str, float] = {}
        self._commit_at: float | None = None
        self._cancel_at: float | None = None

    # ---- runtime side ----------------------------------------------------------------------------------
    def unit_submitted(self, unit: int) -> None:
        self._submitted[unit] = self._clock()

    def runtime_event(self, ev: RuntimeEvent) -> None:
        now = self._clock()
        if isinstance(ev, Decision):
            at = self._submitted.pop(ev.unit, None)
            if at is not None:
                self.m.model_unit.observe(now - at)
            if ev.action == "speak":
                self._speaking[ev.unit] = at if at is not None else now
        elif isinstance(ev, AudioPiece):
            at = self._speaking.pop(ev.unit, None)
            if at is not None:
                self.m.unit_to_first_audio.observe(now - at)

    def cancel_requested(self) -> None:
        self._cancel_at = self._clock()

    # ---- what reached a socket ----------------------------------------------------------------------------
    def sent(self, ev: Json) -> None:
        m, t, now = self.m, ev["type"], self._clock()
        if t == "error":
            m.error_code(ev["error"]["code"])
        elif t == "input_audio_buffer.committed":
            self._commit_at = now
        elif t == "response.created":
            self._created_at[ev["response"]["id"]] = now
        elif t == "response.output_audio.delta":
            self._audio(ev, now)
        elif t == "overlap.decision" and ev.get("action") == "barge_in":
            m.barge_in(BARGE_IN_SOURCES.get(ev.get("reason", ""), "policy"))
        elif t == "response.listen":
            m.listen(str(ev["response"].get("metadata", {}).get("reason", "")))
        elif t == "response.done":
            self._done(ev["response"], now)

    def _audio(self, ev: Json, now: float) -> None:
        m, rid = self.m, ev.get("response_id", "")
        md = ev.get("metadata") or {}
        if "audio_end_ms" in md:
            m.audio_sent((md["audio_end_ms"] - md.get("audio_start_ms", 0)) / MS_PER_S)
        last = self._last_audio_at.get(rid)
        if last is None:
            created = self._created_at.pop(rid, None)
            if created is not None:
                m.created_to_first_audio.observe(now - created)
            if self._commit_at is not None:
                m.commit_to_first_audio.observe(now - self._commit_at)
                self._commit_at = None
        else:
            m.audio_send_interval.observe(now - last)
        self._last_audio_at[rid] = now

    def _done(self, resp: Json, now: float) -> None:
        duplex = resp.get("duplex") or {}
        status, reason = str(resp.get("status", "")), str(duplex.get("reason", ""))
        self.m.response_terminal(status, reason)
        if status == "cancelled" and self._cancel_at is not None:
            self.m.cancel_done(reason, now - self._cancel_at)
            self._cancel_at = None
        for stage in (duplex.get("stage_metrics") or {}).values():
            if isinstance(stage, dict):
                ttft, tpot = stage.get("ttft_ms", stage.get("first_output_ms")), stage.get("tpot_ms")
                self.m.stage_times(str(stage.get("stage", "")), None if ttft is None else ttft / MS_PER_S,
                                   None if tpot is None else tpot / MS_PER_S)
        self._created_at.pop(resp.get("id", ""), None)
        self._last_audio_at.pop(resp.get("id", ""), None)
