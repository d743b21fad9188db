"""`duplex serve`: checkpoint -> model repository -> tritonserver -> gateway, and clean shutdown.

The Triton half (locating the binary, the Python backend stub, ports, readiness) is
serve/tritonserver.py; its public names are re-exported here for callers of the launcher.
This module imports neither torch nor `engine` (it runs in the gateway image too); it only manages processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from serve.mps import MpsDaemon, plan_mps, private_daemon, start_daemon
from serve.stopping import Stop, held, raise_stop
from serve.supervisor import TritonSupervisor
from serve.tritonserver import (  # noqa: F401 - re-exported for the launcher's callers
    COMPILE_CACHE_ENV,
    DEFAULT_CACHE_DIR,
    LOG_TAIL_LINES,
    PROGRESS_EVERY_S,
    READY_POLL_S,
    REPO_ROOT,
    STOP_GRACE_S,
    LaunchError,
    TritonInstall,
    TritonPorts,
    TritonServer,
    check_ports_free,
    choose_triton_ports,
    compile_cache_env,
    http_ok,
    locate_tritonserver,
    port_in_use,
    signal_group,
    stub_pythonpath,
    triton_env,
)

PIPELINE_MODELS = ("stage0", "tts", "token2wav", "duplex")
TRITON_READY_TIMEOUT_S = 600.0
GATEWAY_READY_TIMEOUT_S = 60.0
TINY_SEED = 0


@dataclass(frozen=True)
class ServeOptions:
    port: int = 8000
    host: str = "127.0.0.1"
    checkpoint: Path | None = None
    profile: Path = REPO_ROOT / "deploy" / "profiles" / "default.yaml"
    max_sessions: int | None = None
    cache_dir: Path = DEFAULT_CACHE_DIR
    only: str | None = None  # "triton" | "gateway" (the two containers of docker-compose.yml)
    triton_host: str = "127.0.0.1"
    triton_ports: TritonPorts | None = None  # default: choose_triton_ports(port)
    triton_url: str | None = None  # --only gateway: where Triton's gRPC is

    @property
    def triton_http_port(self) -> int:
        return (self.triton_ports or choose_triton_ports(self.port)).http

    @property
    def triton_grpc_port(self) -> int:
        return (self.triton_ports or choose_triton_ports(self.port)).grpc

    @property
    def triton_metrics_port(self) -> int:
        return (self.triton_ports or choose_triton_ports(self.port)).metrics


def _run_step(what: str, cmd: list[str]) -> None:
    print(f"[serve] {what} ...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    if done.returncode != 0:
        raise LaunchError(f"{what} failed:\n{(done.stderr or done.stdout).strip()}")


def ensure_tiny_checkpoint(cache_dir: Path) -> Path:
    ckpt = cache_dir / "tiny-checkpoint"
    if not (ckpt / "config.json").exists():
        _run_step(f"generating the tiny checkpoint into {ckpt}",
                  [sys.executable, str(REPO_ROOT / "build" / "make_tiny_checkpoint.py"), "--out", str(ckpt),
                   "--seed", str(TINY_SEED)])
    return ckpt


def build_model_repository(opts: ServeOptions, checkpoint: Path, out: Path) -> dict[str, object]:
    cmd = [sys.executable, str(REPO_ROOT / "build" / "make_model_repository.py"), "--checkpoint", str(checkpoint),
           "--profile", str(opts.profile), "--out", str(out)]
    if opts.max_sessions is not None:
        cmd += ["--max-sessions", str(opts.max_sessions)]
    _run_step(f"building the model repository from {opts.profile}", cmd)
    return json.loads((out / "serve.json").read_text())


def load_profile(profile: Path) -> dict[str, object]:
    """Validate the deploy profile (exit message names a bad field) and return its values."""
    cmd = [sys.executable, str(REPO_ROOT / "build" / "make_model_repository.py"), "--check", "--json",
           "--profile", str(profile)]
    print(f"[serve] checking the deploy profile {profile} ...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    if done.returncode != 0:
        raise LaunchError(f"checking the deploy profile {profile} failed:\n{(done.stderr or done.stdout).strip()}")
    return json.loads(done.stdout)


def gateway_env(triton_url: str, profile: dict[str, object]) -> dict[str, str]:
    env = {**os.environ, "DUPLEX_TRITON_URL": triton_url, "DUPLEX_TRITON_MODEL": "duplex",
           "DUPLEX_TRITON_READY_MODELS": ",".join(PIPELINE_MODELS),
           "DUPLEX_MAX_SESSIONS": str(profile["max_sessions"]),
           "DUPLEX_IDLE_TTL_S": str(profile["session_idle_ttl_s"])}
    # The operator's own DUPLEX_UNIT_ALIGN_S (or _MIN_SESSIONS) wins over the profile's: that is how an A/B
    # overrides a profile (an empty one, as compose's `${VAR:-}` gives, counts as unset).
    for var, key in (("DUPLEX_UNIT_ALIGN_S", "unit_align_s"), ("DUPLEX_UNIT_ALIGN_MIN_SESSIONS", "unit_align_min_sessions")):
        if not os.environ.get(var):
            env[var] = str(profile[key])
    return env


def _gateway_available() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("gateway.app") is not None


def _gateway_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # up, not ready (Triton elsewhere may still be loading)
    except OSError:
        return False


def _wait_gateway(proc: subprocess.Popen[bytes], url: str, require_ready: bool,
                  supervisor: TritonSupervisor | None = None) -> None:
    """Wait for the gateway to answer (`require_ready`: to be ready, which needs Triton ready). Triton is
    supervised meanwhile: a tritonserver that dies while the gateway starts is restarted (the gateway's /ready
    could never turn 200 without it), and the time its restart takes does not count against the gateway."""
    t0 = time.monotonic()
    while not (http_ok(f"{url}/ready") if require_ready else _gateway_answers(url)):
        if proc.poll() is not None:
            raise LaunchError(f"the gateway exited with code {proc.returncode} during startup")
        if supervisor is not None:
            before = time.monotonic()
            supervisor.check()
            t0 += time.monotonic() - before
        if time.monotonic() - t0 > GATEWAY_READY_TIMEOUT_S:
            raise LaunchError(f"the gateway did not answer {url}/ready within {GATEWAY_READY_TIMEOUT_S:.0f}s")
        time.sleep(READY_POLL_S)


# Run in a child interpreter: the launcher itself never imports `engine` (it runs in the gateway image too).
_CHECK_CONFIG = """
import sys
try:
    from engine.config import ConfigError, ModelConfig
except ImportError:
    sys.exit(0)  # a gateway-only install: the stages check their checkpoint when they load
try:
    ModelConfig.from_file(sys.argv[1])
except (ConfigError, OSError, ValueError, TypeError) as exc:
    print(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    sys.exit(1)
"""


def check_checkpoint(checkpoint: Path) -> None:
    """A checkpoint whose config.json is missing or invalid fails here, in one line, before Triton starts."""
    config = checkpoint / "config.json"
    if not config.exists():
        raise LaunchError(f"checkpoint {checkpoint} has no config.json")
    done = subprocess.run([sys.executable, "-c", _CHECK_CONFIG, str(config)], capture_output=True, text=True,
                          cwd=REPO_ROOT, check=False)
    if done.returncode != 0:
        why = (done.stdout.strip() or done.stderr.strip() or f"exit code {done.returncode}").splitlines()[-1]
        raise LaunchError(f"{config} is not a valid MiniCPM-o 4.5 config: {why}")


def _prepare_triton(opts: ServeOptions, ports: TritonPorts,
                    extra_env: dict[str, str] | None = None) -> TritonServer:
    """Checkpoint, repository and the (not yet started) server; per gateway port, so two servers on one
    host never rebuild each other's repository or share a log. `extra_env` (the MPS daemon's variables) and the
    compile cache's place are part of the server's environment, so the supervisor's restarts get them too."""
    checkpoint = opts.checkpoint or ensure_tiny_checkpoint(opts.cache_dir)
    check_checkpoint(checkpoint)
    repository = opts.cache_dir / f"model_repository-{opts.port}"
    build_model_repository(opts, checkpoint, repository)
    install = locate_tritonserver(opts.cache_dir)
    env = triton_env(install, {**compile_cache_env(opts.cache_dir, os.environ), **(extra_env or {})})
    compiled = Path(env[COMPILE_CACHE_ENV])
    graphs = sum(1 for p in (compiled / "fxgraph").rglob("*") if p.is_file())
    print(f"[serve] torch.compile cache {compiled}: {graphs} compiled graphs" +
          ("" if graphs else " (a profile that compiles does it in its warm-up, once)"), flush=True)
    return TritonServer(install, repository, PIPELINE_MODELS, ports,
                        opts.cache_dir / "logs" / f"tritonserver-{opts.port}.log", env=env, host=opts.triton_host)


def _start_triton(server: TritonServer) -> None:
    ports = server.ports
    print(f"[serve] starting tritonserver (gRPC {ports.grpc}, HTTP {ports.http}, metrics {ports.metrics}); "
          f"log: {server.log_path}", flush=True)
    server.start()
    server.wait_ready(TRITON_READY_TIMEOUT_S, progress=lambda m: print(m, flush=True))


def _gateway_cmd(opts: ServeOptions) -> list[str]:
    import importlib.util  # noqa: PLC0415

    # gateway.serving drains sessions before uvicorn closes the sockets; plain uvicorn is the fallback.
    if importlib.util.find_spec("gateway.serving") is not None:
        return [sys.executable, "-m", "gateway.serving", "--host", opts.host, "--port", str(opts.port)]
    return [sys.executable, "-m", "uvicorn", "gateway.app:create_app", "--factory", "--host", opts.host,
            "--port", str(opts.port)]


@dataclass
class _Children:
    """What serve() started so far; the `finally` stops exactly these, even mid-startup (a SIGTERM while
    Triton is still loading must not leave it running)."""
    server: TritonServer | None = None
    gateway: subprocess.Popen[bytes] | None = None
    mps: MpsDaemon | None = None  # told to quit after tritonserver (its clients) has stopped
    started: bool = False  # everything asked for came up: a later failure exits 1, not 2

    def stop(self) -> None:
        gateway, self.gateway = self.gateway, None
        if gateway is not None and gateway.poll() is None:
            signal_group(gateway, signal.SIGTERM)
            try:
                gateway.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                signal_group(gateway, signal.SIGKILL)
        if self.server is not None:
            self.server.stop()
        mps, self.mps = self.mps, None
        if mps is not None:
            mps.quit()


def _say(message: str) -> None:
    print(message, flush=True)


def _start_mps(opts: ServeOptions, profile: dict[str, object], kids: _Children) -> None:
    """The profile's MPS choice (serve/mps.py), before the repository build: `mps: on` without MPS fails in one
    line. The daemon joins `kids` before it starts, so the `finally` quits it even if a signal lands mid-start."""
    plan = plan_mps(profile, os.environ)
    if plan.note:
        _say(plan.note)
    kids.mps = private_daemon(plan, opts.cache_dir, opts.port, os.environ)
    if kids.mps is not None and not start_daemon(kids.mps, plan, _say):
        kids.mps = None


def _run(opts: ServeOptions, kids: _Children) -> None:
    """Start what `opts` asks for, then supervise until a signal (raises Stop) or a fatal LaunchError."""
    profile = load_profile(opts.profile)
    if opts.max_sessions is not None:
        profile["max_sessions"] = opts.max_sessions
    ports = opts.triton_ports or choose_triton_ports(opts.port)
    wanted = {} if opts.only == "gateway" else ports.all()
    if opts.only != "triton":
        wanted = {"gateway": opts.port, **wanted}
    check_ports_free(wanted)
    triton_url = opts.triton_url or f"127.0.0.1:{ports.grpc}"
    supervisor = None
    if opts.only != "gateway":
        _start_mps(opts, profile, kids)
        kids.server = _prepare_triton(opts, ports, kids.mps.env if kids.mps else None)
        _start_triton(kids.server)
        # Both halves: from here on a dead tritonserver is restarted under the gateway, also while the gateway
        # is still starting (a crash then used to leave /ready 503 until the launcher gave up and stopped all).
        # `--only triton` (a container of its own) exits on Triton's death instead: its container's restart
        # policy is the supervisor there.
        supervisor = TritonSupervisor(kids.server, _say) if opts.only is None else None
    if opts.only != "triton" and _gateway_available():
        with held():  # a stop inside Popen would leave the gateway running unheld (serve/stopping.py)
            kids.gateway = subprocess.Popen(_gateway_cmd(opts), env=gateway_env(triton_url, profile), cwd=REPO_ROOT,
                                            start_new_session=True)
        base = f"http://{opts.host}:{opts.port}"
        _wait_gateway(kids.gateway, base, require_ready=opts.only != "gateway", supervisor=supervisor)
        _say(f"[serve] demo: {base}/  (Ctrl-C stops)")
    elif opts.only != "triton":
        _say(f"[serve] gateway.app is not present; Triton serves gRPC at {triton_url}. Ctrl-C stops.")
    else:
        _say(f"[serve] Triton serves gRPC at {opts.triton_host}:{ports.grpc}. Ctrl-C stops.")
    kids.started = True
    _supervise(kids, supervisor)


def _supervise(kids: _Children, supervisor: TritonSupervisor | None) -> None:
    """Both halves (`supervisor` given): restart a dead tritonserver under the running gateway. `--only triton`
    (a container of its own) exits on Triton's death instead: its container's restart policy is the supervisor
    there."""
    while True:
        server = kids.server
        if supervisor is not None:
            supervisor.check()
        elif server is not None and (server.proc is None or server.proc.poll() is not None):
            code = -9 if server.proc is None else server.proc.returncode
            raise LaunchError(f"tritonserver stopped unexpectedly: {server.exit_cause(code)}")
        if kids.gateway is not None and kids.gateway.poll() is not None:
            raise LaunchError(f"the gateway exited with code {kids.gateway.returncode}")
        time.sleep(READY_POLL_S)


def serve(opts: ServeOptions) -> int:
    """Run until Ctrl-C/SIGTERM (exit 0) or until a child dies for good (exit 1). Startup errors exit 2."""
    # SIGINT too: a shell that starts us in the background sets SIGINT to "ignore", which Python keeps.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_stop)
    kids = _Children()
    try:
        _run(opts, kids)
    except (KeyboardInterrupt, Stop):
        _say("\n[serve] stopping ...")
        return 0
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1 if kids.started else 2
    finally:
        # a second signal while stopping must not cut the cleanup short
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        kids.stop()
