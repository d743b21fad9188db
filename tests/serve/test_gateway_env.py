"""`duplex serve`'s gateway environment (serve/launcher.py `gateway_env`): the profile's values, and the operator's
DUPLEX_UNIT_ALIGN_S over the profile's `unit_align_s` (how an A/B overrides a profile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from serve.launcher import gateway_env, load_profile

PROFILES = Path(__file__).resolve().parents[2] / "deploy" / "profiles"
PROFILE: dict[str, object] = {"max_sessions": 48, "session_idle_ttl_s": 120, "unit_align_s": 1.0}


def test_the_gateway_gets_the_profiles_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUPLEX_UNIT_ALIGN_S", raising=False)
    env = gateway_env("triton:8001", PROFILE)
    assert (env["DUPLEX_MAX_SESSIONS"], env["DUPLEX_IDLE_TTL_S"], env["DUPLEX_UNIT_ALIGN_S"]) == ("48", "120", "1.0")
    assert GatewaySettings.from_env(env).unit_align_s == 1.0


@pytest.mark.parametrize("operator", ["0", "0.5"])
def test_the_operators_unit_align_s_wins_over_the_profile(monkeypatch: pytest.MonkeyPatch, operator: str) -> None:
    monkeypatch.setenv("DUPLEX_UNIT_ALIGN_S", operator)
    assert gateway_env("triton:8001", PROFILE)["DUPLEX_UNIT_ALIGN_S"] == operator


def test_an_empty_unit_align_s_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_UNIT_ALIGN_S", "")  # what compose's ${DUPLEX_UNIT_ALIGN_S:-} passes
    assert gateway_env("triton:8001", PROFILE)["DUPLEX_UNIT_ALIGN_S"] == "1.0"


def test_shipped_profiles_reach_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real `--check --json`: only the 64-session capacity profile turns the alignment on."""
    monkeypatch.delenv("DUPLEX_UNIT_ALIGN_S", raising=False)
    aligned = GatewaySettings.from_env(gateway_env("t:1", load_profile(PROFILES / "h200-64-scripted.yaml")))
    off = GatewaySettings.from_env(gateway_env("t:1", load_profile(PROFILES / "default.yaml")))
    assert (aligned.unit_align_s, off.unit_align_s) == (1.0, 0.0)
