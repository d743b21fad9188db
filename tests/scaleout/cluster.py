"""A scale-out deployment as subprocesses: N `duplex serve --only triton` replicas, gateways routing over them, and
a redis-server for the shared session directory.

Built on tests/e2e/stack.py (`Proc`: own process group, killed with it at teardown). Every replica serves the
same deploy profile (DUPLEX_E2E_PROFILE, default deploy/profiles/default.yaml: the tiny checkpoint on the real
engines) from one cache dir; the checkpoint is made once before the replicas start so they do not race for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from serve.launcher import ensure_tiny_checkpoint
from tests.e2e.stack import (
    POLL_S,
    READY_TIMEOUT_S,
    Proc,
    children_of,
    cmdline,
    http_status,
    profile_path,
)
from tests.ports import free_port


@dataclass
class Replica:
    """One `duplex serve --only triton`: its launcher process and Triton's three ports."""
    name: str
    proc: Proc
    port: int  # the launcher's --port (names its repository and log)
    http: int
    grpc: int
    metrics: int

    @property
    def spec(self) -> str:
        """Its DUPLEX_TRITON_REPLICAS entry."""
        return f"127.0.0.1:{self.grpc}|127.0.0.1:{self.metrics}"

    def ready(self) -> bool:
        return http_status(f"http://127.0.0.1:{self.http}/v2/health/ready") == 200

    def tritonserver_pid(self) -> int | None:
        if self.proc.popen is None:
            return None
        return next((p for p in children_of(self.proc.popen.pid) if "tritonserver" in cmdline(p).split(" ", 1)[0]),
                    None)

    def kill(self) -> None:
        """SIGKILL tritonserver, as a crash would (its launcher then exits on its own)."""
        pid = self.tritonserver_pid()
        assert pid is not None, f"{self.name}: no tritonserver child"
        os.killpg(pid, signal.SIGKILL)
        self.proc.stop(signal.SIGKILL)


@dataclass
class Gateway:
    name: str
    proc: Proc
    port: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        """SIGSTOP the gateway process (uvicorn, in its own group): alive, its sockets open, but unheard of (a
        gateway cut off from Redis, or stalled); `cont` lets it go on."""
        self._signal_children(signal.SIGSTOP)

    def cont(self) -> None:
        self._signal_children(signal.SIGCONT)

    def _signal_children(self, sig: signal.Signals) -> None:
        assert self.proc.popen is not None
        for pid in children_of(self.proc.popen.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)

    def kill(self) -> None:
        """SIGKILL the gateway process (uvicorn, in its own group) and its launcher, as a crash would."""
        assert self.proc.popen is not None
        for pid in children_of(self.proc.popen.pid):
            _kill_group(pid)
        self.proc.stop(signal.SIGKILL)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Redis:
    """A real redis-server on a free port, nothing persisted."""
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ready(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False


@dataclass
class Cluster:
    cache_dir: Path
    replica_sessions: int = 2  # each replica's max_sessions
    profile: Path = field(default_factory=profile_path)
    env: dict[str, str] = field(default_factory=dict)  # extra DUPLEX_* settings for every gateway
    replicas: list[Replica] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)
    redis: Redis | None = None

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.pop("DUPLEX_TEST_GATEWAY_URL", None)
        return env

    def _serve(self, port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "serve.cli", "serve", "--port", str(port), "--profile", str(self.profile),
                "--cache-dir", str(self.cache_dir), *extra]

    def start_replicas(self, n: int, *, wait: bool = True) -> None:
        """`wait=False`: return once started; `start_gateways` then waits for the replicas with the gateways."""
        ensure_tiny_checkpoint(self.cache_dir)
        for i in range(n):
            port, http, grpc, metrics = free_port(), free_port(), free_port(), free_port()
            argv = self._serve(port, "--only", "triton", "--max-sessions", str(self.replica_sessions),
                               "--triton-http-port", str(http), "--triton-grpc-port", str(grpc),
                               "--triton-metrics-port", str(metrics))
            proc = Proc(argv, self.cache_dir / "logs" / f"replica{i}.log", self._env())
            proc.start()
            self.replicas.append(Replica(f"r{i}", proc, port, http, grpc, metrics))
        if wait:
            self._wait(lambda: all(r.ready() for r in self.replicas), [r.proc for r in self.replicas])

    def start_redis(self) -> Redis:
        port = free_port()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.redis = Redis(Proc(argv, self.cache_dir / "logs" / "redis.log", self._env()), port)
        self.redis.proc.start()
        self._wait(self.redis.ready, [self.redis.proc])
        return self.redis

    def start_gateways(self, n: int) -> list[Gateway]:
        """`n` gateways over every replica; with the directory when redis runs. Started together, then awaited."""
        sessions = str(self.replica_sessions * len(self.replicas))  # a gateway admits what the replicas hold
        started = []
        for _ in range(n):
            port = free_port()
            argv = self._serve(port, "--only", "gateway", "--triton-url", self.replicas[0].spec.split("|")[0],
                               "--max-sessions", sessions)
            env = {**self._env(), "DUPLEX_TRITON_REPLICAS": ",".join(r.spec for r in self.replicas)}
            if self.redis is not None:
                env |= {"DUPLEX_REDIS_URL": self.redis.url, "DUPLEX_ADVERTISE_ADDR": f"127.0.0.1:{port}"}
            gw = Gateway(f"g{len(self.gateways)}", Proc(argv, self.cache_dir / "logs" / f"gateway{port}.log", env),
                         port)
            gw.proc.start()
            self.gateways.append(gw)
            started.append(gw)
        # a gateway is ready once one replica is: wait until each gateway reports every replica ready (its gRPC
        # channel to a replica that was still starting reconnects with backoff, so this can lag the replica)
        self._wait(lambda: all(self.sees_all_replicas(g) for g in started),
                   [g.proc for g in started] + [r.proc for r in self.replicas])
        return started

    def sees_all_replicas(self, gw: Gateway) -> bool:
        """The gateway's /ready names every replica's stage0 ready (gateway/runtime/replicas.py readiness)."""
        try:
            with urllib.request.urlopen(f"http://{gw.addr}/ready", timeout=2.0) as resp:
                models = json.load(resp)["checks"]["models"]
        except (OSError, ValueError, KeyError):
            return False
        return all(models.get(f"r{i}/stage0") is True for i in range(len(self.replicas)))

    def _wait(self, done, procs: list[Proc], timeout_s: float = READY_TIMEOUT_S) -> None:
        t0 = time.monotonic()
        while not done():
            dead = [p for p in procs if not p.alive()]
            if dead or time.monotonic() - t0 > timeout_s:
                logs = "\n".join(f"--- {p.log.name} ---\n{p.tail()}" for p in procs)
                raise RuntimeError(f"not ready after {time.monotonic() - t0:.0f}s\n{logs}")
            time.sleep(POLL_S)

    def stop(self) -> None:
        procs = [g.proc for g in self.gateways] + [r.proc for r in self.replicas]
        procs += [self.redis.proc] if self.redis is not None else []
        kids = [k for p in procs if p.popen is not None for k in children_of(p.popen.pid)]
        for proc in procs:
            proc.stop()
        for pid in kids:
            _kill_group(pid)
