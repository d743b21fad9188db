"""The seeded random client of tests/gateway/test_random_client.py against the real stack (tritonserver, the tiny
checkpoint's engines, the gateway): random well-formed and bad frames in any order get their typed errors, never an
internal fault or a closed session, and the stream stays conformant."""

from __future__ import annotations

import pytest

from tests.e2e.stack import SHARED_ENV
from tests.gateway.random_client import random_client

pytestmark = pytest.mark.e2e
STACK_ENV = SHARED_ENV  # the stack test_conformance and test_response_temperature share


@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/duplex"])
async def test_random_frames_on_the_real_stack(addr: str, path: str) -> None:
    await random_client(addr, path, seed=7, frames=150)
