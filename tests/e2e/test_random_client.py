"""The seeded random client of tests/gateway/test_random_client.py against the real stack (tritonserver, the tiny
checkpoint's engines, the gateway): random well-formed and bad frames in any order get their typed errors, never an
internal fault or a closed session, and the stream stays conformant."""

from __future__ import annotations

import pytest

from tests.e2e.stack import SHARED_ENV
from tests.gateway.random_client import main, random_client

pytestmark = pytest.mark.e2e
STACK_ENV = SHARED_ENV  # the stack test_conformance and test_response_temperature share


@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/duplex"])
async def test_random_frames_on_the_real_stack(addr: str, path: str) -> None:
    await random_client(addr, path, seed=7, frames=150)


def test_the_seed_sweep_passes_on_the_real_stack(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m tests.gateway.random_client`, the sweep docs/deploy.md gives operators: two clients at once."""
    assert main(["--addr", addr, "--seeds", "3-5", "--concurrent", "2", "--frames", "60"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "0 failure(s) in 4 runs"

