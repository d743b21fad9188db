"""The settings of several gateways refuse what cannot work: a directory in pipeline mode (adoption and the sweep go
through the stage models' sequences) and a copy TTL too short for a dead gateway's sessions to stay adoptable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.app import create_app
from gateway.settings import GatewaySettings

DIRECTORY = {"DUPLEX_REDIS_URL": "redis://127.0.0.1:6379/0", "DUPLEX_ADVERTISE_ADDR": "127.0.0.1:8000"}


def test_a_gateway_with_a_directory_does_not_start_in_pipeline_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**DIRECTORY, "DUPLEX_TRITON_MODE": "pipeline"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError, match="redis_url .* needs triton_mode=stages"):
        create_app()  # what `duplex serve --only gateway` builds at startup
    monkeypatch.setenv("DUPLEX_TRITON_MODE", "stages")
    assert GatewaySettings.from_env().redis_url == DIRECTORY["DUPLEX_REDIS_URL"]


def test_the_copy_ttl_defaults_from_the_lease_grace_and_replay_ttl_and_refuses_too_short() -> None:
    s = GatewaySettings.from_env(DIRECTORY)
    assert s.directory_copy_ttl_s is None and s.copy_ttl_s() == 3 * (10.0 + 30.0 + 60.0)
    env = {**DIRECTORY, "DUPLEX_DIRECTORY_LEASE_S": "2", "DUPLEX_DISCONNECT_GRACE_S": "5"}
    assert GatewaySettings.from_env(env).copy_ttl_s() == 3 * (2.0 + 5.0 + 60.0)
    assert GatewaySettings.from_env({**env, "DUPLEX_DIRECTORY_COPY_TTL_S": "8"}).copy_ttl_s() == 8.0
    with pytest.raises(ValidationError, match="must exceed directory_lease_s"):
        GatewaySettings.from_env({**env, "DUPLEX_DIRECTORY_COPY_TTL_S": "7"})
