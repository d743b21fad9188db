"""`duplex serve` as a process manager, through the real tritonserver (issue 18 point 6, issue 17 launcher).

- Triton dies under a running `duplex serve`: sessions get `runtime_dead`, `/ready` is 503 while it is down,
  the launcher logs the cause and restarts it (the gateway process stays), the dead server's /dev/shm
  regions are removed, and new sessions are served again.
- SIGTERM while tritonserver is still starting leaves no process behind.
- Two `duplex serve` on one host with different `--port` (and no Triton ports given) both come up, each on
  its own tritonserver.
- A bad checkpoint config.json fails before Triton starts, with one clear line.

All use the torch-free loopback profile: the engines play no part here, and each Triton start stays short
(bench/soak.py kills and restarts Triton under real engines).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve.tritonserver import SHM_DIR, mapped_shm_regions, process_listens_on
from tests.e2e.stack import REPO_ROOT, Proc, Stack, children_of, cmdline, http_status, stop_soon
from tests.e2e.wire import WAIT_S, collect_until, fit_units, send_audio, silence
from tests.gateway_ops.wire import eventually, http_get, opened
from tests.ports import free_port

pytestmark = pytest.mark.e2e

LOOPBACK = REPO_ROOT / "tests" / "e2e" / "profiles" / "loopback.yaml"
DOWN_WAIT_S = 10.0  # kill -> /ready 503 (the gateway probes Triton on each /ready with DUPLEX_READY_CACHE_S=0)
BACK_WAIT_S = 90.0  # backoff (1 s) + a fresh tritonserver on 2 shared cores
START_WAIT_S = 150.0
EXIT_WAIT_S = 20.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _group_alive(pgid: int) -> bool:
    return any(_alive(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == pgid)


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _tritonserver_of(launcher_pid: int) -> int | None:
    return next((p for p in children_of(launcher_pid) if "tritonserver" in cmdline(p).split(" ", 1)[0]), None)


def _wait_for_triton(proc: Proc, logged_ready: bool = False) -> int:
    """The pid of the launcher's tritonserver once it runs (`logged_ready`: once the launcher logged it ready)."""
    assert proc.popen is not None
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_WAIT_S:
        assert proc.alive(), proc.tail()
        if not logged_ready or "[triton] ready in" in proc.log.read_text(errors="replace"):
            triton = _tritonserver_of(proc.popen.pid)
            if triton is not None:
                return triton
        time.sleep(0.02)
    raise AssertionError(f"no tritonserver after {START_WAIT_S} s: {proc.tail()}")


def _serve_proc(cache: Path, port: int, log_name: str, *extra: str, profile: Path = LOOPBACK) -> Proc:
    argv = [sys.executable, "-m", "serve.cli", "serve", "--port", str(port), "--profile", str(profile),
            "--cache-dir", str(cache), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DUPLEX_READY_CACHE_S": "0"}
    return Proc(argv, cache / "logs" / log_name, env)


async def _ready(addr: str) -> bool:
    return (await http_get(addr, "/ready")).status_code == 200


async def _not_ready(addr: str) -> bool:
    return (await http_get(addr, "/ready")).status_code == 503


async def _logged(proc: Proc, line: str) -> bool:
    return line in proc.log.read_text(errors="replace")


async def _one_unit_decided(addr: str) -> None:
    c, _ = await opened(addr)
    await send_audio(c, fit_units(silence(0), 1), pace=0)
    await collect_until(c, lambda e: e["type"] in ("response.listen", "response.created"), WAIT_S)
    await c.ws.close()


@pytest.fixture(scope="module")
def supervised(e2e_cache: Path) -> Iterator[Stack]:
    s = Stack(e2e_cache, profile=LOOPBACK, env={"DUPLEX_READY_CACHE_S": "0", "DUPLEX_FORCE_LISTEN_COUNT": "0"})
    s.start()
    try:
        yield s
    finally:
        s.stop_soon()


@pytest.mark.timeout(360)
async def test_triton_crash_is_restarted_under_the_gateway(supervised: Stack) -> None:
    addr, launcher = supervised.addr, supervised.procs["serve"]
    assert launcher.popen is not None
    old = supervised.tritonserver_pid()
    assert old is not None
    regions = mapped_shm_regions(old)
    assert regions, "the Python backend maps its /dev/shm regions"
    gateway = [p for p in children_of(launcher.popen.pid) if p != old]
    c, _ = await opened(addr)
    os.kill(old, signal.SIGKILL)  # a crash of the server alone: its backend stubs are left behind
    err = await c.until("error", DOWN_WAIT_S)
    assert err["error"]["code"] == "runtime_dead", err
    await eventually(lambda: _not_ready(addr), DOWN_WAIT_S)
    await eventually(lambda: _ready(addr), BACK_WAIT_S, every_s=0.5)
    # the gateway probes Triton itself, so it may turn ready a poll before the supervisor logs the restart
    await eventually(lambda: _logged(launcher, "tritonserver is back"), DOWN_WAIT_S, every_s=0.1)
    new = supervised.tritonserver_pid()
    assert new is not None and new != old and launcher.alive()
    assert [p for p in children_of(launcher.popen.pid) if p != new] == gateway  # the same gateway process
    assert not [r for r in regions if (SHM_DIR / r).exists()], "the dead server's regions were removed"
    log = launcher.log.read_text(errors="replace")
    cause = log[log.index("tritonserver killed by SIGKILL"):]
    assert "restarting tritonserver" in cause and "tritonserver is back" in cause, cause[:2000]
    await _one_unit_decided(addr)  # a real unit through the restarted server


@pytest.mark.timeout(240)
async def test_triton_crash_while_the_gateway_starts_is_restarted(e2e_cache: Path) -> None:
    """Triton dies after it became ready but before the launcher saw the gateway ready (the gateway takes
    seconds to import): the launcher restarts it then too, and `duplex serve` comes up with that same gateway
    (it used to wait for a /ready that could not turn 200, give up after 60 s and stop everything)."""
    port = free_port()
    proc = _serve_proc(e2e_cache, port, "crash-during-start.log")
    proc.start()
    assert proc.popen is not None
    try:
        triton = _wait_for_triton(proc, logged_ready=True)
        os.kill(triton, signal.SIGKILL)
        assert "[serve] demo" not in proc.log.read_text(errors="replace"), "killed after startup: proves nothing"
        gateway = [p for p in children_of(proc.popen.pid) if p != triton]
        addr = f"127.0.0.1:{port}"
        await eventually(lambda: _logged(proc, "[serve] demo"), BACK_WAIT_S, every_s=0.2)
        assert await _ready(addr)
        new = _tritonserver_of(proc.popen.pid)
        assert new is not None and new != triton and proc.alive()
        assert [p for p in children_of(proc.popen.pid) if p != new] == gateway  # the same gateway process
        log = proc.log.read_text(errors="replace")
        assert "tritonserver killed by SIGKILL" in log and "tritonserver is back (restart 1)" in log, log[-3000:]
        await _one_unit_decided(addr)
    finally:
        kids = children_of(proc.popen.pid) if proc.popen is not None else []

        def stop() -> None:
            proc.stop()
            for pid in kids:  # tritonserver and the gateway run in process groups of their own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)

        stop_soon(stop, "crash-during-start")


@pytest.mark.timeout(120)
def test_sigterm_during_triton_startup_leaves_no_process(e2e_cache: Path) -> None:
    proc = _serve_proc(e2e_cache, free_port(), "sigterm.log")
    proc.start()
    assert proc.popen is not None
    try:
        triton = _wait_for_triton(proc)
        assert http_status(f"http://127.0.0.1:{proc_port(proc)}/ready") != 200  # still starting
        proc.popen.send_signal(signal.SIGTERM)  # the launcher alone, as `kill PID` or systemd would
        assert proc.popen.wait(timeout=EXIT_WAIT_S) == 0, proc.tail()
        assert not _alive(triton), "tritonserver outlived its launcher"
        assert not _group_alive(triton), "a backend stub outlived its launcher"
    finally:
        proc.stop(signal.SIGKILL)


def proc_port(proc: Proc) -> int:
    return int(proc.argv[proc.argv.index("--port") + 1])


@pytest.mark.timeout(300)
def test_two_servers_on_one_host_with_different_ports(e2e_cache: Path) -> None:
    ports = [free_port(), free_port()]
    procs = [_serve_proc(e2e_cache, p, f"two-{i}.log") for i, p in enumerate(ports)]
    try:
        for p in procs:
            p.start()
            time.sleep(1.0)  # within seconds of each other: both pass their port checks
        t0 = time.monotonic()
        while not all(http_status(f"http://127.0.0.1:{port}/ready") == 200 for port in ports):
            dead = [p.tail() for p in procs if not p.alive()]
            assert not dead and time.monotonic() - t0 < START_WAIT_S, "\n---\n".join(dead) or "not ready"
            time.sleep(0.5)
        for proc in procs:
            assert proc.popen is not None
            triton = _tritonserver_of(proc.popen.pid)
            assert triton is not None
            argv = cmdline(triton)
            http = int(argv.split("--http-port=")[1].split()[0])
            grpc = int(argv.split("--grpc-port=")[1].split()[0])
            assert process_listens_on(triton, http) and process_listens_on(triton, grpc), argv
    finally:
        for p in procs:
            stop_soon(p.stop, "two-servers")


def test_bad_config_json_fails_before_triton(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["MiniCPMO"], "hidden_size": "big"}))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "serve.cli", "serve", "--port", str(free_port()),
                           "--checkpoint", str(ckpt), "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and str(ckpt / "config.json") in errors[0] and "config." in errors[0], done.stderr
    assert "starting tritonserver" not in done.stdout
    assert not list((tmp_path / "cache").glob("logs/tritonserver*")), "Triton was started"
    assert time.monotonic() - t0 < 60
