"""`duplex serve`'s gateway environment (serve/launcher.py `gateway_env`): the profile's values, and the operator's
DUPLEX_UNIT_ALIGN_S / DUPLEX_UNIT_ALIGN_MIN_SESSIONS over the profile's (how an A/B overrides a profile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from serve.launcher import gateway_env, load_profile

PROFILES = Path(__file__).resolve().parents[2] / "deploy" / "profiles"
PROFILE: dict[str, object] = {"max_sessions": 48, "session_idle_ttl_s": 120, "unit_align_s": 1.0,
                               "unit_align_min_sessions": 24}
ALIGN_VARS = ("DUPLEX_UNIT_ALIGN_S", "DUPLEX_UNIT_ALIGN_MIN_SESSIONS")


def test_the_gateway_gets_the_profiles_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ALIGN_VARS:
        monkeypatch.delenv(var, raising=False)
    env = gateway_env("triton:8001", PROFILE)
    assert (env["DUPLEX_MAX_SESSIONS"], env["DUPLEX_IDLE_TTL_S"], env["DUPLEX_UNIT_ALIGN_S"]) == ("48", "120", "1.0")
    settings = GatewaySettings.from_env(env)
    assert (settings.unit_align_s, settings.unit_align_min_sessions) == (1.0, 24)


@pytest.mark.parametrize("var,operator", [("DUPLEX_UNIT_ALIGN_S", "0"), ("DUPLEX_UNIT_ALIGN_S", "0.5"),
                                          ("DUPLEX_UNIT_ALIGN_MIN_SESSIONS", "8")])
def test_the_operators_alignment_wins_over_the_profile(monkeypatch: pytest.MonkeyPatch, var: str,
                                                       operator: str) -> None:
    monkeypatch.setenv(var, operator)
    assert gateway_env("triton:8001", PROFILE)[var] == operator


def test_an_empty_unit_align_s_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_UNIT_ALIGN_S", "")  # what compose's ${DUPLEX_UNIT_ALIGN_S:-} passes
    assert gateway_env("triton:8001", PROFILE)["DUPLEX_UNIT_ALIGN_S"] == "1.0"


def test_shipped_profiles_reach_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real `--check --json`: only the 64-session capacity profile turns the alignment on."""
    for var in ALIGN_VARS:
        monkeypatch.delenv(var, raising=False)
    aligned = GatewaySettings.from_env(gateway_env("t:1", load_profile(PROFILES / "h200-64-scripted.yaml")))
    off = GatewaySettings.from_env(gateway_env("t:1", load_profile(PROFILES / "default.yaml")))
    assert (aligned.unit_align_s, off.unit_align_s) == (1.0, 0.0)
