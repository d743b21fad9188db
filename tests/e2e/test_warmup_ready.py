"""Warm before ready (issue 15): while a stage warms up in `initialize`, Triton does not report it ready and
the gateway's /ready answers 503; it turns 200 only after the warm-up, whose progress lines are in the log.
The real tritonserver and gateway, split (`--only triton` + `--only gateway`), with stand-in engines whose
stage0 warm-up blocks until the test opens a gate; meanwhile the launcher's progress names the warm-up step."""

from __future__ import annotations

import time
from pathlib import Path

from tests.e2e.slow_warmup import GATE_ENV
from tests.e2e.stack import REPO_ROOT, Stack, http_status

PROFILE = REPO_ROOT / "tests" / "e2e" / "profiles" / "slow_warmup.yaml"
HOLD_S = 3.0  # how long the test keeps the warm-up waiting while it watches /ready
WAIT_S = 60.0


def _wait_for(what: str, check: object, stack: Stack, timeout_s: float = WAIT_S) -> None:
    t0 = time.monotonic()
    while not check():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout_s or not all(p.alive() for p in stack.procs.values()):
            logs = "\n".join(f"--- {n} ---\n{p.tail()}" for n, p in stack.procs.items())
            raise AssertionError(f"{what} not seen after {time.monotonic() - t0:.0f} s\n{logs}")
        time.sleep(0.1)


def _log(stack: Stack) -> str:
    """tritonserver's own log (the stub's `pb_utils.Logger` lines land there, not in the launcher's)."""
    path = stack.cache_dir / "logs" / f"tritonserver-{stack.port}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_slow_warm_up_keeps_ready_at_503(e2e_cache: Path, tmp_path: Path) -> None:
    gate = tmp_path / "warm-up.gate"
    stack = Stack(e2e_cache, profile=PROFILE, env={GATE_ENV: str(gate)}, mode="split")
    for name in ("triton", "gateway"):  # not Stack.start: it would wait for a ready Triton
        stack.procs[name] = stack._proc(name, name)
        stack.procs[name].start()
    try:
        _wait_for("the stage0 warm-up waiting", lambda: "waiting for" in _log(stack), stack)
        # Triton answers HTTP only after its models load, so the launcher's progress line reads the step from the log
        _wait_for("the launcher's progress naming stage0's warm-up step",
                  lambda: "stage0=warm-up 0/1" in stack.procs["triton"].tail(), stack)
        _wait_for("the gateway answering", lambda: http_status(f"{stack.url}/ready") != 0, stack)
        t0 = time.monotonic()
        while time.monotonic() - t0 < HOLD_S:
            assert http_status(f"{stack.url}/ready") == 503
            assert not stack.triton_ready()
            time.sleep(0.2)
        gate.touch()
        stack.wait_ready(timeout_s=WAIT_S)
        assert stack.triton_ready()
        log = _log(stack)
        assert "stage0: warm-up 1/1: gate open" in log and "stage0: warm-up finished" in log
    finally:
        stack.stop_soon()
