from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability import GatewayMetrics

SPEC_METRICS = (  # protocol.md §10.4 (counter names without the _total suffix, as the parser reports them)
    "duplex_sessions", "duplex_session_limit", "duplex_admission_rejected", "duplex_sessions_ended",
    "duplex_responses", "duplex_listen_decisions", "duplex_commit_to_first_audio_seconds",
    "duplex_response_created_to_first_audio_seconds", "duplex_audio_send_interval_seconds",
    "duplex_model_unit_seconds", "duplex_unit_to_first_audio_seconds", "duplex_cancel_to_response_done_seconds",
    "duplex_stage_ttft_seconds", "duplex_stage_tpot_seconds", "duplex_input_backpressure",
    "duplex_stale_events_dropped", "duplex_barge_in", "duplex_resume", "duplex_takeover",
    "duplex_journal_overflow", "duplex_ignored_binary_frames", "duplex_runtime_errors",
)


def families(m: GatewayMetrics) -> dict[str, object]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain") and "0.0.4" in ctype
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(m: GatewayMetrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    body, _ = m.render()
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    return None


def test_every_spec_metric_is_exposed_with_process_defaults() -> None:
    fams = families(GatewayMetrics(4))
    missing = [n for n in SPEC_METRICS if n not in fams]
    assert missing == []
    assert "process_cpu_seconds" in fams or "python_info" in fams


def test_per_app_registry_is_isolated() -> None:
    a, b = GatewayMetrics(1, process_defaults=False), GatewayMetrics(2, process_defaults=False)
    a.admission_refused("resource_exhausted")
    assert sample(a, "duplex_admission_rejected_total", {"code": "resource_exhausted"}) == 1
    assert sample(b, "duplex_admission_rejected_total", {"code": "resource_exhausted"}) is None
    assert REGISTRY.get_sample_value("duplex_session_limit") is None  # nothing on the global registry
    assert sample(b, "duplex_session_limit") == 2


def test_session_gauge_by_state() -> None:
    m = GatewayMetrics(3, process_defaults=False)
    m.set_session_counts({"open": 2, "detached": 1, "closing": 0})
    assert sample(m, "duplex_sessions", {"state": "open"}) == 2
    assert sample(m, "duplex_sessions", {"state": "detached"}) == 1
    assert sample(m, "duplex_sessions", {"state": "closing"}) == 0


def test_labels_never_carry_client_strings() -> None:
    m = GatewayMetrics(1, process_defaults=False)
    m.admission_refused("sess_0123456789abcdef")
    m.barge_in("evil\"label")
    m.input_backpressure("frames")
    m.session_ended("client said: bye now")
    m.resume_result("sess_abc")
    assert sample(m, "duplex_admission_rejected_total", {"code": "other"}) == 1
    assert sample(m, "duplex_barge_in_total", {"source": "other"}) == 1
    assert sample(m, "duplex_input_backpressure_total", {"kind": "other"}) == 1
    assert sample(m, "duplex_sessions_ended_total", {"reason": "other"}) == 1
    assert sample(m, "duplex_resume_total", {"result": "other"}) == 1


def test_runtime_errors_count_server_errors_only() -> None:
    m = GatewayMetrics(1, process_defaults=False)
    m.error_code("runtime_dead")
    m.error_code("bad_event")  # invalid_request_error: not a runtime error
    assert sample(m, "duplex_runtime_errors_total", {"code": "runtime_dead"}) == 1
    assert sample(m, "duplex_runtime_errors_total", {"code": "bad_event"}) is None


def test_histograms_and_extensions() -> None:
    m = GatewayMetrics(1, process_defaults=False)
    m.model_unit.observe(0.9)
    m.cancel_done("turn_detected", 0.2)
    m.stage_times("talker", 0.05, None)
    m.appends.inc()
    m.audio_sent(1.5)
    m.audio_sent(-1.0)  # never decreases
    assert sample(m, "duplex_model_unit_seconds_count") == 1
    assert sample(m, "duplex_cancel_to_response_done_seconds_count", {"reason": "turn_detected"}) == 1
    assert sample(m, "duplex_stage_ttft_seconds_count", {"stage": "talker"}) == 1
    assert sample(m, "duplex_stage_tpot_seconds_count", {"stage": "talker"}) is None
    assert sample(m, "duplex_input_appends_total") == 1
    assert sample(m, "duplex_audio_output_seconds_total") == 1.5
