"""The seeded random client of tests/gateway/test_random_client.py against the real stack (tritonserver, the tiny
checkpoint's engines, the gateway): random well-formed and bad frames in any order get their typed errors, never an
internal fault or a closed session, and the stream stays conformant."""

from __future__ import annotations

import pytest

from tests.e2e.stack import SHARED_ENV
from tests.gateway.harness import connect
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


async def test_an_update_right_after_a_cancel_is_applied_on_the_real_stack(addr: str) -> None:
    """The fault the random client found, on purpose: a cancel advances the epoch, and the update right behind it
    carries that epoch; the gateway sends it only once stage0 has adopted it (tests/gateway/test_cancel.py has the
    deterministic fake-runtime test)."""
    async with connect(addr, "/v1/realtime") as c:
        await c.until("session.created")
        for i in range(6):
            await c.send({"type": "input.cancel"})
            await c.send({"type": "session.update", "event_id": f"u{i}",
                          "session": {"output_modalities": ["text" if i % 2 else "audio"]}})
            answer = await c.recv()
            while answer["type"] not in ("session.updated", "error"):
                answer = await c.recv()
            assert answer["type"] == "session.updated", answer
