"""The issue-7 scenarios against an already running gateway (real Triton): `DUPLEX_TEST_GATEWAY_URL`.

Skipped unless that variable names a running stack. The Triton kill/restore scenario
(`test_wired_admission.scenario_runtime_failure`) needs callables that stop and restart tritonserver, so
the e2e suite that owns the stack calls it; the auth scenario needs a stack started with DUPLEX_API_KEYS.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.gateway_ops.test_wired_admission import scenario_capacity
from tests.gateway_ops.test_wired_resume import (
    scenario_grace_expiry,
    scenario_resume_replays_and_rotates,
    scenario_takeover,
)
from tests.gateway_ops.test_wired_vad import scenario_vad_speech_vs_silence
from tests.gateway_ops.wire import http_get

GATEWAY_URL_ENV = "DUPLEX_TEST_GATEWAY_URL"


@pytest.fixture
def addr() -> str:
    url = os.environ.get(GATEWAY_URL_ENV)
    if not url:
        pytest.skip(f"{GATEWAY_URL_ENV} is not set (needs a running gateway + tritonserver)")
    return url.split("://", 1)[-1].rstrip("/")


@pytest.mark.timeout(120)
async def test_capacity(addr: str) -> None:
    caps = (await http_get(addr, "/v1/duplex/capabilities")).json()
    await scenario_capacity(addr, caps["limits"]["max_sessions"])


@pytest.mark.timeout(120)
async def test_resume_and_takeover(addr: str) -> None:
    await scenario_resume_replays_and_rotates(addr)
    await scenario_takeover(addr)


@pytest.mark.timeout(180)
async def test_grace_expiry(addr: str) -> None:
    await scenario_grace_expiry(addr)


@pytest.mark.timeout(120)
async def test_vad(addr: str, speech: np.ndarray) -> None:
    await scenario_vad_speech_vs_silence(addr, speech)
