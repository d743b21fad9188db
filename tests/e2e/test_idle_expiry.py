"""Issue 18 point 1: an idle-expired session gives its admission slot back, through the real tritonserver.

The deploy profile's `session_idle_ttl_s` is both the gateway's idle TTL and the Triton models' own idle
expiry, so when the gateway closes an idle session the models have usually forgotten its sequence already and
the close answers `session_not_found`. That answer means "already closed": the slot must be freed, not retried
forever (which left a `--max-sessions 1` server refusing everyone with `resource_exhausted`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, profile_path
from tests.e2e.wire import WAIT_S, collect_until, fit_units, send_audio, silence
from tests.gateway_ops.test_wired_admission import refusal
from tests.gateway_ops.wire import eventually, http_get, metric, opened
from tests.ports import free_port

pytestmark = pytest.mark.e2e

IDLE_TTL_S = 2
SEQUENCE_IDLE_S = 3
EXPIRY_WAIT_S = 15.0  # TTL + reaper cadence + the close on 2 shared cores
READMIT_WAIT_S = 10.0  # a few cleanup retries (base 0.1 s, capped at the 0.5 s reaper interval)


def _short_ttl_profile(folder: Path) -> Path:
    lines = []
    for line in profile_path().read_text().splitlines():
        key = line.partition(":")[0].strip()
        if key == "session_idle_ttl_s":
            line = f"session_idle_ttl_s: {IDLE_TTL_S}"
        elif key == "sequence_idle_timeout_s":
            line = f"sequence_idle_timeout_s: {SEQUENCE_IDLE_S}"
        lines.append(line)
    out = folder / "short-ttl.yaml"
    out.write_text("\n".join(lines) + "\n")
    return out


ENV = {"DUPLEX_REAPER_INTERVAL_S": "0.5", "DUPLEX_CLEANUP_RETRY_BASE_S": "0.1", "DUPLEX_READY_CACHE_S": "0",
       "DUPLEX_FORCE_LISTEN_COUNT": "0"}


@pytest.fixture(scope="module")
def triton_half(e2e_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One `duplex serve --only triton` (one sequence slot) for both runtimes, each with a gateway of its own."""
    profile = _short_ttl_profile(tmp_path_factory.mktemp("profile"))
    s = Stack(e2e_cache, profile=profile, max_sessions=1, env=ENV, mode="split")
    s.procs["triton"] = s._proc("triton", "triton")
    s.procs["triton"].start()
    try:
        s.wait_triton_ready()
        yield s
    finally:
        s.stop_soon()


@pytest.fixture(params=["stages", "pipeline"])
def one_slot(request: pytest.FixtureRequest, triton_half: Stack) -> Iterator[Stack]:
    """Both runtimes: the session frees the slot whichever of them reports the sequence already gone."""
    s = triton_half
    s.env, s.port = {**ENV, "DUPLEX_TRITON_MODE": request.param}, free_port()
    gateway = s.procs["gateway"] = s._proc("gateway", "gateway")
    gateway.start()
    try:
        s.wait_ready()
        yield s
    finally:
        s.procs.pop("gateway", gateway).stop()


async def test_idle_expired_session_frees_its_slot(one_slot: Stack) -> None:
    addr = one_slot.addr
    c, _ = await opened(addr)
    await send_audio(c, fit_units(silence(0), 1), pace=0)  # one real unit: Triton holds the sequence
    # the client says nothing more: idle expiry (it may come before the unit's decision on a slow machine)
    closed = await collect_until(c, lambda e: e["type"] == "session.expired", EXPIRY_WAIT_S + WAIT_S)
    assert closed["reason"] == "idle_ttl_expired", closed
    assert (await c.closed())[0] == 1000

    async def readmitted() -> bool:
        return (await refusal(addr))[0] == "admitted"

    await eventually(readmitted, READMIT_WAIT_S, every_s=0.5)
    text = (await http_get(addr, "/metrics")).text
    assert sum(metric(text, "duplex_sessions", state=st) for st in ("open", "detached", "closing")) == 0
