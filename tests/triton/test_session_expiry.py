"""A stage forgets an idle session when Triton drops its sequence, not at the gateway's own idle TTL."""

from __future__ import annotations

from model_repository.common.settings import StageSettings, session_expiry_s


def _settings(ttl: float) -> StageSettings:
    return StageSettings(stage="stage0", engine_factory="m:f", checkpoint_dir="", device="cpu", dtype="float32",
                         max_sessions=2, kv_window=64, session_idle_ttl_s=ttl)


def test_the_sequence_idle_timeout_wins_over_the_gateway_ttl() -> None:
    config = {"sequence_batching": {"max_sequence_idle_microseconds": "360000000"}}
    assert session_expiry_s(_settings(300.0), config) == 360.0


def test_without_a_sequence_timeout_the_ttl_stays() -> None:
    assert session_expiry_s(_settings(300.0), {}) == 300.0
    assert session_expiry_s(_settings(300.0), {"sequence_batching": {"max_sequence_idle_microseconds": "x"}}) == 300.0
    assert session_expiry_s(_settings(400.0), {"sequence_batching": {"max_sequence_idle_microseconds": 1_000_000}}) \
        == 400.0
