"""The real stack as subprocesses: `python -m serve.cli serve ...` (tritonserver + gateway), or its two halves.

Every process runs in its own process group and is killed with it (SIGTERM, then SIGKILL) at teardown, pass or
fail. Ports are chosen free on loopback (Triton's three too: the launcher's 8001-8003 defaults would collide
with other servers on a shared machine). The deploy profile comes from DUPLEX_E2E_PROFILE (default:
deploy/profiles/default.yaml) so the same suite runs on the loopback stand-in and on the real engines.

A stack that no test uses any more is stopped on a thread of its own (`stop_soon`): its graceful stop (Triton
unloads its models for several seconds) overlaps the next test instead of delaying it; `wait_stopped` joins
those threads at the end of the session and raises what a stop raised.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.ports import free_port

if TYPE_CHECKING:
    import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE_ENV = "DUPLEX_E2E_PROFILE"
DEFAULT_PROFILE = REPO_ROOT / "deploy" / "profiles" / "default.yaml"
MAX_SESSIONS = 2
READY_TIMEOUT_S = float(os.environ.get("DUPLEX_E2E_READY_TIMEOUT_S", "240"))  # real engines load slower
POLL_S = 0.2
STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 4000
CACHE_NAME = "e2e-cache"
# Gateway settings that several modules share one stack with (tests/e2e/conftest.py starts one stack per
# profile, env and mode). Each setting is one a module needs; none changes what another module checks.
# test_conformance, test_response_temperature (test_clients keeps the default force_listen_count: its openai SDK
# test wants audio in the first delta, which a unit-0 answer of the tiny random model need not have):
SHARED_ENV = {
    "DUPLEX_FORCE_LISTEN_COUNT": "0",  # loud units may speak at once (short audio on a 2-core machine)
    # a socket closed without session.close holds its slot this long, not 30 s into the next module;
    # test_ops' grace-expiry scenario waits it out
    "DUPLEX_DISCONNECT_GRACE_S": "1.5",
    "DUPLEX_REAPER_INTERVAL_S": "0.2",
}
# test_ops, test_close_backlog:
OPS_ENV = {
    **SHARED_ENV,
    # ~62 s of 16 kHz pcm16: test_ops' oversized append never fits; test_close_backlog's 40 s backlog and the
    # ~6 s bursts of test_ops' VAD scenario do (appends with camera frames count their JPEGs: not on this stack)
    "DUPLEX_MAX_PENDING_INPUT_BYTES_PER_SESSION": "2000000",
    "DUPLEX_READY_CACHE_S": "0",
    "DUPLEX_CLOSE_ACK_TIMEOUT_S": "5",  # test_close_backlog: its backlog takes stage0 several times this
}


def session_cache(factory: pytest.TempPathFactory) -> Path:
    """One cache dir per test session (`factory`: pytest's tmp_path_factory) for every stack, in any test
    directory: the tiny checkpoint is generated once, each stack builds its own model repository."""
    path = factory.getbasetemp() / CACHE_NAME
    path.mkdir(exist_ok=True)
    return path


_stopping: list[threading.Thread] = []
_stop_errors: list[BaseException] = []


def stop_soon(stop: Callable[[], object], name: str = "stack") -> None:
    """Run `stop` on a (non-daemon) thread: the interpreter waits for it at exit even if nobody joins it."""
    def run() -> None:
        try:
            stop()
        except BaseException as exc:  # raised again by wait_stopped
            _stop_errors.append(exc)

    thread = threading.Thread(target=run, name=f"stop-{name}")
    thread.start()
    _stopping.append(thread)


def wait_stopped(timeout_s: float = 120.0) -> None:
    """Join every `stop_soon` thread; raise the first error a stop raised."""
    while _stopping:
        _stopping.pop().join(timeout_s)
    if _stop_errors:
        errors = list(_stop_errors)
        _stop_errors.clear()
        raise RuntimeError(f"{len(errors)} background stop(s) failed") from errors[0]


def profile_path() -> Path:
    raw = os.environ.get(PROFILE_ENV)
    if not raw:
        return DEFAULT_PROFILE
    path = Path(raw)
    return path if path.is_absolute() else REPO_ROOT / path


def profile_engine(profile: Path | None = None) -> str:
    """The profile's `engine:` (loopback | torch); the loopback stand-in speaks exactly on loud units."""
    for line in (profile or profile_path()).read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "engine":
            return value.split("#", 1)[0].strip()
    return "torch"


def http_status(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, http.client.HTTPException):  # not up yet, or something else (not HTTP/1) answers the port
        return 0


@dataclass
class Proc:
    """One launcher process in its own process group, its output in a log file."""
    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=REPO_ROOT, env=self.env, start_new_session=True)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        proc, self.popen = self.popen, None
        if proc is None:
            return
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(proc.pid, s)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=STOP_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def children_of(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; no psutil needed)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Stack:
    """`duplex serve` with free ports; `mode` "both" (one launcher) or "split" (triton and gateway launchers)."""
    cache_dir: Path
    profile: Path = field(default_factory=profile_path)
    env: dict[str, str] = field(default_factory=dict)  # extra DUPLEX_* settings for the gateway
    mode: str = "both"
    max_sessions: int = MAX_SESSIONS
    port: int = field(default_factory=free_port)
    triton_ports: tuple[int, int, int] = field(default_factory=lambda: (free_port(), free_port(), free_port()))
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def _argv(self, only: str | None) -> list[str]:
        http, grpc, metrics = self.triton_ports
        argv = [sys.executable, "-m", "serve.cli", "serve", "--port", str(self.port), "--profile", str(self.profile),
                "--max-sessions", str(self.max_sessions), "--cache-dir", str(self.cache_dir),
                "--triton-http-port", str(http), "--triton-grpc-port", str(grpc), "--triton-metrics-port", str(metrics)]
        if only == "gateway":
            argv += ["--only", "gateway", "--triton-url", f"127.0.0.1:{grpc}"]
        elif only == "triton":
            argv += ["--only", "triton"]
        return argv

    def _proc(self, name: str, only: str | None) -> Proc:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.pop("DUPLEX_TEST_GATEWAY_URL", None)
        return Proc(self._argv(only), self.cache_dir / "logs" / f"{name}-{self.port}.log", env)

    def start(self) -> None:
        names = {"both": [("serve", None)], "split": [("triton", "triton"), ("gateway", "gateway")]}[self.mode]
        for name, only in names:
            proc = self.procs[name] = self._proc(name, only)
            proc.start()
            if name == "triton":
                self.wait_triton_ready()
        self.wait_ready()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        t0 = time.monotonic()
        while http_status(f"{self.url}/ready") != 200:
            dead = [n for n, p in self.procs.items() if not p.alive()]
            if dead or time.monotonic() - t0 > timeout_s:
                logs = "\n".join(f"--- {n} ---\n{p.tail()}" for n, p in self.procs.items())
                self.stop()
                raise RuntimeError(f"stack not ready (dead: {dead}) after {time.monotonic() - t0:.0f}s\n{logs}")
            time.sleep(POLL_S)

    def triton_ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.triton_ports[0]}/v2/health/ready") == 200

    def wait_triton_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        t0 = time.monotonic()
        while not self.triton_ready():
            proc = self.procs["triton"]
            if not proc.alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"tritonserver not ready after {time.monotonic() - t0:.0f}s\n{proc.tail()}")
            time.sleep(POLL_S)

    def tritonserver_pid(self) -> int | None:
        """The tritonserver process the launcher started (a child of the serve/triton launcher)."""
        launcher = self.procs.get("triton") or self.procs.get("serve")
        if launcher is None or launcher.popen is None:
            return None
        for pid in children_of(launcher.popen.pid):
            if "tritonserver" in cmdline(pid).split(" ", 1)[0]:
                return pid
        return None

    def kill_triton(self) -> int | None:
        """SIGKILL tritonserver, as a crash would. In split mode, returns how its `--only triton` launcher exited
        (it does not supervise Triton: it notices the death and exits 1); the gateway process is untouched."""
        pid = self.tritonserver_pid()
        assert pid is not None, "no tritonserver child found"
        _kill_group(pid)
        if self.mode != "split":
            return None
        launcher = self.procs["triton"]
        assert launcher.popen is not None
        try:
            code = launcher.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        launcher.stop(signal.SIGKILL)
        return code

    def restart_triton(self) -> None:
        assert self.mode == "split", "only the split stack can restart Triton under a running gateway"
        proc = self.procs["triton"] = self._proc("triton", "triton")
        proc.start()
        self.wait_triton_ready()

    def stop(self) -> None:
        # the launcher starts tritonserver and the gateway in process groups of their own: if a launcher has to
        # be SIGKILLed, they must not outlive it, so note them first
        kids = [k for p in self.procs.values() if p.popen is not None for k in children_of(p.popen.pid)]
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        for pid in kids:
            _kill_group(pid)
        self.procs.clear()

    def stop_soon(self) -> None:
        """`stop` on a thread of its own (see `stop_soon`)."""
        stop_soon(self.stop, f"stack-{self.port}")

    def sessions(self) -> float | None:
        """Sessions the gateway holds (every state counts toward max_sessions), from its /metrics; None if it
        does not answer."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=2.0) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith("duplex_sessions{"):
                total += float(line.rpartition(" ")[2])
        return total
