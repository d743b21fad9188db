"""bench/gateway_overhead.py (P10) against the real stack: the gateway of `duplex serve` (loopback engines in the
real tritonserver) and the bare echo server, two sessions for a few seconds each, real WebSockets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_both_servers_answer_and_the_ratio_is_their_cpu_per_event(tmp_path: Path) -> None:
    out = tmp_path / "p10.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "gateway_overhead.py"), "--sessions", "2", "--duration", "3",
                    "--port", str(free_port()), "--json", str(out)], check=True, cwd=REPO, capture_output=True,
                   timeout=280)
    result = json.loads(out.read_text())
    echo, gateway = result["echo"], result["gateway"]
    assert echo["frames_out"] == echo["frames_in"] > 0 and echo["errors"] == 0  # every frame came back
    assert gateway["frames_in"] >= 2 * 3 * 10 and gateway["frames_out"] > 2  # session.created and responses
    assert gateway["errors"] == 0
    assert gateway["cpu_s"] > 0  # a gateway that did the work used CPU for it
    if echo["cpu_s"] > 0:  # the echo's few frames may fit inside one clock tick
        assert result["ratio"] == round(gateway["cpu_us_per_event"] / echo["cpu_us_per_event"], 2)
