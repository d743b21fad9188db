"""Prometheus metrics of protocol.md §10.4 on a per-app `CollectorRegistry` (never the module-global one).

`GatewayMetrics` is built once per app (`create_app`) and handed to whoever records. No label carries a
session id, response id or any other client-controlled string (§10.4): every label value passes through a
closed set here, and anything outside it is recorded as `other`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from gateway.protocol.errors import CODES, ErrorClass

SESSION_STATES = ("open", "detached", "closing")
ADMISSION_CODES = frozenset({"resource_exhausted", "runtime_unavailable"})
BACKPRESSURE_KINDS = frozenset({"bytes", "turns"})
BARGE_IN_SOURCES = frozenset({"client", "policy", "vad"})
SERVER_ERROR_CODES = frozenset(c for c, spec in CODES.items() if spec.cls is ErrorClass.SERVER)
OTHER = "other"
# Gateway-clock latencies: a ~1 s model unit dominates, so buckets span 10 ms .. 10 s.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
STAGES = frozenset({"thinker", "talker", "code2wav"})
# P13 (docs/design/targets.md: text behind its generation <= 30 ms p50): fine edges below 100 ms, 30 ms among them,
# and a unit's worth of TTS + Token2Wav above, where text that waits for its audio pair (/v1/duplex) lands.
TEXT_WAIT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                       10.0)
# the event loop's lag (gateway/looplag.py): an idle loop runs a timer within a millisecond; a loop that delays every
# session's events by a large part of a 1 s unit is at its limit
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _closed(value: str, allowed: Iterable[str]) -> str:
    return value if value in allowed else OTHER


def _word(value: str) -> str:
    """Server-chosen enum-like strings (reasons, statuses, event types): bounded and label-safe."""
    ok = 0 < len(value) <= 64 and all(ch.isalnum() or ch in "._-" for ch in value)
    return value if ok else OTHER


class GatewayMetrics:
    """Every §10.4 metric, plus two issue-7 extensions: appends and audio seconds sent."""

    def __init__(self, max_sessions: int, *, process_defaults: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if process_defaults:  # §11.5 "plus process defaults", on this registry only
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        self.sessions = Gauge("duplex_sessions", "Sessions by state (all count toward max_sessions)",
                              ["state"], registry=r)
        for st in SESSION_STATES:
            self.sessions.labels(st).set(0)
        self.session_limit = Gauge("duplex_session_limit", "Configured max_sessions", registry=r)
        self.session_limit.set(max_sessions)
        self.admission_rejected = Counter("duplex_admission_rejected_total", "Handshake refusals", ["code"],
                                          registry=r)
        self.sessions_ended = Counter("duplex_sessions_ended_total", "session.closed/expired reasons",
                                      ["reason"], registry=r)
        self.responses = Counter("duplex_responses_total", "Terminal responses", ["status", "reason"], registry=r)
        self.listens = Counter("duplex_listen_decisions_total", "response.listen events", ["reason"], registry=r)

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS_S, registry=r)

        self.commit_to_first_audio = hist("duplex_commit_to_first_audio_seconds", "commit -> first audio delta")
        self.created_to_first_audio = hist("duplex_response_created_to_first_audio_seconds",
                                           "response.created -> first audio delta")
        self.audio_send_interval = hist("duplex_audio_send_interval_seconds", "between audio deltas")
        self.model_unit = hist("duplex_model_unit_seconds", "unit submitted -> decision received")
        self.unit_to_first_audio = hist("duplex_unit_to_first_audio_seconds", "speaking unit -> first audio")
        self.cancel_to_done = hist("duplex_cancel_to_response_done_seconds", "K0 -> K8", ("reason",))
        self.stage_ttft = hist("duplex_stage_ttft_seconds", "engine-clock stage TTFT", ("stage",))
        self.stage_tpot = hist("duplex_stage_tpot_seconds", "engine-clock stage TPOT", ("stage",))
        self.backpressure = Counter("duplex_input_backpressure_total", "input_backpressure errors", ["kind"],
                                    registry=r)
        self.stale_dropped = Counter("duplex_stale_events_dropped_total", "§3.9 S-3", ["type"], registry=r)
        self.barge_ins = Counter("duplex_barge_in_total", "Barge-ins", ["source"], registry=r)
        self.resumes = Counter("duplex_resume_total", "Resume attempts", ["result"], registry=r)
        self.takeovers = Counter("duplex_takeover_total", "Takeovers", registry=r)
        self.journal_overflows = Counter("duplex_journal_overflow_total", "Journal overflows", registry=r)
        self.ignored_binary = Counter("duplex_ignored_binary_frames_total", "Ignored binary frames", registry=r)
        self.runtime_errors = Counter("duplex_runtime_errors_total", "server_error codes", ["code"], registry=r)
        # Extensions named by issue 7 (not in §10.4's table; names follow its conventions).
        self.appends = Counter("duplex_input_appends_total", "Admitted input_audio_buffer.append events",
                               registry=r)
        self.audio_out = Counter("duplex_audio_output_seconds_total", "Audio seconds written to clients",
                                 registry=r)
        # Issue 14 / P13: how long generated text waited before its delta was handed to the socket.
        self.transcript_delay = Histogram(
            "duplex_transcript_delay_seconds",
            "Text behind its generation: first token of a transcript/text delta sampled by the engine (start="
            "sampled) or received by the gateway (start=received) -> the delta handed to the socket",
            ["response", "start"], buckets=TEXT_WAIT_BUCKETS_S, registry=r)
        self.loop_lag = Histogram("duplex_event_loop_lag_seconds",
                                  "How much later than asked the event loop ran a 100 ms timer (gateway/looplag.py)",
                                  buckets=LOOP_LAG_BUCKETS_S, registry=r)
        # children resolved once: the writer observes per delta without building a label tuple ([audio][sampled])
        self._text_waits = [[self.transcript_delay.labels(resp, start) for start in ("received", "sampled")]
                            for resp in ("text", "audio")]

    # ---- helpers: one call per observable fact --------------------------------------------------------
    def set_session_counts(self, counts: dict[str, int]) -> None:
        for st in SESSION_STATES:
            self.sessions.labels(st).set(counts.get(st, 0))

    def admission_refused(self, code: str) -> None:
        self.admission_rejected.labels(_closed(code, ADMISSION_CODES)).inc()

    def session_ended(self, reason: str) -> None:
        self.sessions_ended.labels(_word(reason)).inc()

    def response_terminal(self, status: str, reason: str) -> None:
        self.responses.labels(_word(status), _word(reason)).inc()

    def listen(self, reason: str) -> None:
        self.listens.labels(_word(reason)).inc()

    def cancel_done(self, reason: str, seconds: float) -> None:
        self.cancel_to_done.labels(_word(reason)).observe(seconds)

    def stage_times(self, stage: str, ttft_s: float | None, tpot_s: float | None) -> None:
        label = _closed(stage, STAGES)
        if ttft_s is not None:
            self.stage_ttft.labels(label).observe(ttft_s)
        if tpot_s is not None:
            self.stage_tpot.labels(label).observe(tpot_s)

    def input_backpressure(self, kind: str) -> None:
        self.backpressure.labels(_closed(kind, BACKPRESSURE_KINDS)).inc()

    def stale_dropped_event(self, event_type: str) -> None:
        self.stale_dropped.labels(_word(event_type)).inc()

    def barge_in(self, source: str) -> None:
        self.barge_ins.labels(_closed(source, BARGE_IN_SOURCES)).inc()

    def resume_result(self, result: str) -> None:
        """`ok` or the error code of the failed attempt."""
        self.resumes.labels(_closed(result, CODES.keys() | {"ok", "resync_required"})).inc()

    def error_code(self, code: str) -> None:
        """Counts server_error codes of §1.7 only; client-side codes are not runtime errors."""
        if code in SERVER_ERROR_CODES:
            self.runtime_errors.labels(code).inc()

    def audio_sent(self, seconds: float) -> None:
        self.audio_out.inc(max(0.0, seconds))

    def transcript_delayed(self, seconds: float, audio: bool, sampled: bool) -> None:
        """A delta's text waited `seconds` (the writer's hook; `audio`: a transcript paired with audio, C-3)."""
        self._text_waits[audio][sampled].observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """Body and content type for `GET /metrics` (text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4  # text format 0.0.4, as §11.5 pins it


# Query parameters that may carry a credential. The gateway reads keys only from headers or the subprotocol,
# but a client may still put one in the URL (`?api_key=`), and uvicorn logs every request line with its query.
SECRET_QUERY = re.compile(r"([?&](?:api_key|apikey|key|token|access_token|resume_token)=)[^&\s\"]*", re.IGNORECASE)
REDACTED = "[redacted]"
SERVER_LOGGERS = ("uvicorn.access", "uvicorn.error")  # request lines; WebSocket "[accepted]" lines


class RedactSecrets(logging.Filter):
    """Rewrites credential values in a log record's message and string arguments (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = SECRET_QUERY.sub(rf"\1{REDACTED}", record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(SECRET_QUERY.sub(rf"\1{REDACTED}", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


def redact_server_logs() -> None:
    """Attach `RedactSecrets` to uvicorn's loggers (after uvicorn configured logging); idempotent."""
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
