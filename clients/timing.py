"""`EventCollector`: the client-side timing names of protocol.md §10.2, on the client's monotonic clock.

Feed it every frame the client sends (`on_send`) and every event it receives (`on_event`), each with the
monotonic time in seconds at which it happened; `summary()` returns the figures partitioned by response id.
Engine `stage_metrics` (§10.1) are copied under their own key and never mixed with client values (§10.3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from clients.events import AudioDelta, InputCommitted, ResponseCreated, ResponseDone, ServerEvent
from clients.stats import simulate_gapless_player, summarize

CANCEL_FRAMES = ("response.cancel", "barge_in", "output_audio_buffer.clear")
SendLabel = Literal["speech_end", "overlap_speech"]


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass
class _Response:
    response_id: str
    created_t: float
    recv_t: list[float] = field(default_factory=list)
    dur_ms: list[float] = field(default_factory=list)
    commit_t: float | None = None  # send time of the commit this response answers (§10.2 row 1)
    speech_end_t: float | None = None
    cancel_t: float | None = None
    done: ResponseDone | None = None


@dataclass
class _Commit:
    sent_t: float
    committed: bool = False
    no_response: bool = False


class EventCollector:
    def __init__(self) -> None:
        self._responses: dict[str, _Response] = {}
        self._active: str | None = None
        self._commits: list[_Commit] = []
        self._awaiting_response: _Commit | None = None  # committed, no response created since
        self._speech_end_t: float | None = None
        self._overlap_t: float | None = None
        self._last_append_t: float | None = None
        self._barge_in_to_cleared: list[float] = []

    # -- inputs -------------------------------------------------------------------------------------
    def on_send(self, frame: Mapping[str, Any], t: float, label: SendLabel | None = None) -> None:
        kind = frame.get("type")
        if kind == "input_audio_buffer.commit":
            self._commits.append(_Commit(t))
            self._awaiting_response = None  # an older commit with no response yet stays absent
        elif kind == "input_audio_buffer.append":
            self._last_append_t = t
            if label == "speech_end":
                self._speech_end_t = t
            elif label == "overlap_speech" and self._overlap_t is None:
                self._overlap_t = t
            if (frame.get("force_barge_in") or frame.get("overlap_action") == "barge_in") and self._active:
                self._mark_cancel(t)
        elif kind in CANCEL_FRAMES and self._active is not None:
            self._mark_cancel(t)

    def on_event(self, ev: ServerEvent, t: float) -> None:
        if isinstance(ev, InputCommitted):
            pending = next((c for c in self._commits if not c.committed), None)
            if pending is not None:
                pending.committed, pending.no_response = True, ev.no_response
                self._awaiting_response = None if ev.no_response else pending
        elif isinstance(ev, ResponseCreated):
            self._on_created(ev, t)
        elif isinstance(ev, AudioDelta):
            r = self._responses.get(ev.response_id)
            if r is not None:
                r.recv_t.append(t)
                r.dur_ms.append(ev.duration_ms)
        elif isinstance(ev, ResponseDone):
            r = self._responses.get(ev.response_id)
            if r is not None:
                r.done = ev
            if self._active == ev.response_id:
                self._active = None
        elif ev.type == "output_audio_buffer.cleared" and self._overlap_t is not None:
            self._barge_in_to_cleared.append(_ms(t - self._overlap_t))
            self._overlap_t = None
        elif ev.type == "overlap.decision" and ev.raw.get("action") == "barge_in":
            # the append that produced it is at the latest the last one sent before this receipt
            if self._active is not None and self._last_append_t is not None:
                self._mark_cancel(self._last_append_t)

    def end_overlap_episode(self) -> None:
        """Call when the client's overlap speech ends without a barge-in (so a later episode starts anew)."""
        self._overlap_t = None

    def _on_created(self, ev: ResponseCreated, t: float) -> None:
        r = _Response(ev.response_id, t)
        if self._awaiting_response is not None:
            r.commit_t, self._awaiting_response = self._awaiting_response.sent_t, None
        if self._speech_end_t is not None:
            r.speech_end_t, self._speech_end_t = self._speech_end_t, None
        self._responses[ev.response_id] = r
        self._active = ev.response_id

    def _mark_cancel(self, t: float) -> None:
        r = self._responses.get(self._active or "")
        if r is not None and r.cancel_t is None:
            r.cancel_t = t

    # -- output -------------------------------------------------------------------------------------
    def response_summary(self, response_id: str) -> dict[str, Any]:
        r = self._responses[response_id]
        client: dict[str, Any] = {}
        first = r.recv_t[0] if r.recv_t else None
        if first is not None:
            client["response_created_to_first_audio_ms"] = _ms(first - r.created_t)
            if r.commit_t is not None:
                client["commit_to_first_audio_ms"] = _ms(first - r.commit_t)
            if r.speech_end_t is not None:
                client["speech_end_to_first_audio_ms"] = _ms(first - r.speech_end_t)
        recv_ms = [_ms(x) for x in r.recv_t]
        gaps = [b - a for a, b in zip(recv_ms, recv_ms[1:], strict=False)]
        under = simulate_gapless_player(recv_ms, r.dur_ms)
        client.update({
            "inter_chunk_interval_ms": summarize(gaps),
            "chunk_duration_ms": summarize(r.dur_ms),
            "max_chunk_gap_ms": round(max(gaps), 3) if gaps else 0.0,
            "max_underrun_ms": under.max_ms,
            "total_underrun_ms": under.total_ms,
        })
        if r.cancel_t is not None and r.done is not None and r.done.status == "cancelled":
            after = [x for x in r.recv_t if x >= r.cancel_t]
            client["cancel_to_last_audio_ms"] = _ms(after[-1] - r.cancel_t) if after else 0.0
        out: dict[str, Any] = {"response_id": response_id, "audio_ms": round(sum(r.dur_ms), 3),
                               "chunks": len(r.dur_ms), "client": client}
        if r.done is not None:
            out.update(status=r.done.status, reason=r.done.reason, transcript=r.done.transcript)
            if "stage_metrics" in r.done.duplex:
                out["engine"] = r.done.duplex["stage_metrics"]
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "clock": "client_monotonic",
            "responses": [self.response_summary(rid) for rid in self._responses],
            "commits": len(self._commits),
            "barge_in_to_cleared_ms": list(self._barge_in_to_cleared),
        }
