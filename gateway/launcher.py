"""Start the real tritonserver on this machine and wait until its models are ready.

On a plain machine the binary, the Python backend and its per-Python-version stubs come from the
`nvidia-pytriton` wheel; inside NVIDIA's Triton container `tritonserver` is on PATH with its own
backends. The Python backend wants its stub next to `libtriton_python.so`, and the stub (which links
Debian's libpython3.11) must find torch and the project through PYTHONPATH, so we lay out a private
backend folder under the cache dir and hand the server a prepared environment.

This module imports neither torch nor `engine` (the gateway rule); it only manages processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache"
STUB_NAME = "triton_python_backend_stub"
READY_POLL_S = 0.25
PROGRESS_EVERY_S = 3.0
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 40
# Python-backend shared memory per model instance. The 1 MiB default grows under concurrent
# decoupled BLS traffic; start large enough that one second of audio per session never grows it.
PY_SHM_DEFAULT_BYTES = 64 * 1024 * 1024
PY_SHM_GROWTH_BYTES = 16 * 1024 * 1024


class LaunchError(RuntimeError):
    """A startup failure with a message meant for the person at the terminal."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path  # folder holding python/ (libtriton_python.so + utils + stub)
    lib_dirs: tuple[Path, ...]  # LD_LIBRARY_PATH entries the binary needs


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int

    def all(self) -> dict[str, int]:
        return {"Triton HTTP": self.http, "Triton gRPC": self.grpc, "Triton metrics": self.metrics}


def _wheel_root() -> Path | None:
    try:
        import pytriton  # noqa: PLC0415 - optional: absent inside NVIDIA's container
    except ImportError:
        return None
    return Path(pytriton.__file__).resolve().parent


def locate_tritonserver(cache_dir: Path = DEFAULT_CACHE_DIR) -> TritonInstall:
    """Find tritonserver: the nvidia-pytriton wheel first, else `tritonserver` on PATH (container)."""
    root = _wheel_root()
    if root is not None and (root / "tritonserver" / "bin" / "tritonserver").exists():
        server = root / "tritonserver"
        libs = root.parent / "nvidia_pytriton.libs"
        backend_dir = _prepare_wheel_backends(server, cache_dir / "triton-backends")
        return TritonInstall(server / "bin" / "tritonserver", backend_dir, (libs,))
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), Path("/opt/tritonserver/backends"), ())
    raise LaunchError(
        "tritonserver not found: install the pinned nvidia-pytriton wheel (`make install`) "
        "or run inside NVIDIA's Triton container"
    )


def _prepare_wheel_backends(server: Path, dest: Path) -> Path:
    """Copy the python backend plus the stub for this interpreter into one folder (idempotent)."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / py / STUB_NAME
    if not stub.exists():
        raise LaunchError(f"nvidia-pytriton has no Python backend stub for Python {py} ({stub})")
    target = dest / "python"
    target.mkdir(parents=True, exist_ok=True)
    sources = [*sorted((server / "backends" / "python").glob("*.*")), stub]
    for src in sources:
        dst = target / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return dest


def stub_pythonpath(install: TritonInstall) -> str:
    """Backend folder (triton_python_backend_utils) + this venv's site-packages + the repo root."""
    paths = sysconfig.get_paths()
    parts = [str(install.backend_dir / "python"), paths["purelib"], paths["platlib"], str(REPO_ROOT)]
    return os.pathsep.join(dict.fromkeys(parts))


def triton_env(install: TritonInstall, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(p) for p in install.lib_dirs]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PYTHONPATH"] = stub_pythonpath(install)
    # NOTE: the stub's embedded interpreter only picks up the venv's site-packages when the venv's
    # bin/ leads PATH (as after `activate`); PYTHONPATH alone left it without numpy.
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = sys.prefix
    env.update(extra or {})
    return env


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def choose_triton_ports(gateway_port: int, base: int = 8001) -> TritonPorts:
    """Triton's three ports out of the gateway's way: 8001-8003, shifted past a collision."""
    start = base
    while gateway_port in range(start, start + 3):
        start += 3
    return TritonPorts(http=start, grpc=start + 1, metrics=start + 2)


def check_ports_free(named_ports: dict[str, int]) -> None:
    for name, port in named_ports.items():
        if port_in_use(port):
            raise LaunchError(f"port {port} ({name}) is already in use; choose another port or stop the other server")


class TritonServer:
    """One tritonserver process in its own process group, with its log in a file."""

    def __init__(self, install: TritonInstall, repository: Path, models: Sequence[str], ports: TritonPorts,
                 log_path: Path, env: dict[str, str] | None = None, log_verbose: int = 0,
                 host: str = "127.0.0.1") -> None:
        self.install, self.repository, self.models, self.ports = install, repository, list(models), ports
        self.log_path, self.env, self.log_verbose, self.host = log_path, env, log_verbose, host
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    def command(self) -> list[str]:
        cmd = [
            str(self.install.binary), f"--model-repository={self.repository}",
            f"--backend-directory={self.install.backend_dir}", "--model-control-mode=explicit",
            f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}", f"--http-address={self.host}", f"--grpc-address={self.host}",
            "--allow-gpu-metrics=false", "--exit-on-error=true", "--strict-readiness=true",
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-default-byte-size={PY_SHM_DEFAULT_BYTES}",
            f"--backend-config=python,shm-growth-byte-size={PY_SHM_GROWTH_BYTES}",
        ]
        return cmd + [f"--load-model={m}" for m in self.models]

    def start(self) -> None:
        check_ports_free(self.ports.all())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env or triton_env(self.install), start_new_session=True,
            )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def load_errors(self) -> list[str]:
        """Lines of the log that name a failing model or port (what a person needs to see)."""
        keys = ("failed to load", "failed to start", "already in use", "error:", "Traceback", "Error")
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [ln.strip() for ln in text.splitlines() if any(k in ln for k in keys)]

    def model_states(self) -> dict[str, str]:
        try:
            index = _http_json(f"{self.http_url}/v2/repository/index", method="POST", body=b"{}")
        except (OSError, ValueError):
            return {}
        return {m["name"]: f'{m.get("state", "?")}{": " + m["reason"] if m.get("reason") else ""}' for m in index}

    def is_ready(self) -> bool:
        return all(_http_ok(f"{self.http_url}/v2/models/{m}/ready") for m in self.models) and _http_ok(
            f"{self.http_url}/v2/health/ready")

    def wait_ready(self, timeout_s: float, progress: Callable[[str], None] = print) -> None:
        assert self.proc is not None, "start() first"
        t0 = last = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LaunchError(self._exit_message(code))
            if self.is_ready():
                progress(f"[triton] ready in {time.monotonic() - t0:.1f}s: {', '.join(self.models)}")
                return
            now = time.monotonic()
            if now - t0 > timeout_s:
                states = self.model_states()
                self.stop()
                raise LaunchError(f"tritonserver not ready after {timeout_s:.0f}s; model states: {states}\n"
                                  f"log tail ({self.log_path}):\n{self.log_tail()}")
            if now - last >= PROGRESS_EVERY_S:
                states = self.model_states() or dict.fromkeys(self.models, "starting")
                progress(f"[triton] waiting ({now - t0:.0f}s): " + ", ".join(f"{k}={v}" for k, v in states.items()))
                last = now
            time.sleep(READY_POLL_S)

    def _exit_message(self, code: int) -> str:
        errors = self.load_errors()
        detail = "\n  ".join(errors[-12:]) if errors else self.log_tail()
        return f"tritonserver exited with code {code} during startup:\n  {detail}\n(full log: {self.log_path})"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _http_json(url: str, method: str = "GET", body: bytes | None = None) -> list[dict[str, str]]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=2.0) as resp:
        return json.loads(resp.read())


# ---- `duplex serve`: checkpoint -> model repository -> tritonserver -> gateway -----------------------

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
    return {**os.environ, "DUPLEX_TRITON_URL": triton_url, "DUPLEX_TRITON_MODEL": "duplex",
            "DUPLEX_TRITON_READY_MODELS": ",".join(PIPELINE_MODELS),
            "DUPLEX_MAX_SESSIONS": str(profile["max_sessions"]),
            "DUPLEX_IDLE_TTL_S": str(profile["session_idle_ttl_s"])}


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


def _wait_gateway(proc: subprocess.Popen[bytes], url: str, require_ready: bool) -> None:
    t0 = time.monotonic()
    while not (_http_ok(f"{url}/ready") if require_ready else _gateway_answers(url)):
        if proc.poll() is not None:
            raise LaunchError(f"the gateway exited with code {proc.returncode} during startup")
        if time.monotonic() - t0 > GATEWAY_READY_TIMEOUT_S:
            raise LaunchError(f"the gateway did not answer {url}/ready within {GATEWAY_READY_TIMEOUT_S:.0f}s")
        time.sleep(READY_POLL_S)


class _Stop(Exception):
    pass


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _start_triton(opts: ServeOptions, ports: TritonPorts) -> TritonServer:
    checkpoint = opts.checkpoint or ensure_tiny_checkpoint(opts.cache_dir)
    if not (checkpoint / "config.json").exists():
        raise LaunchError(f"checkpoint {checkpoint} has no config.json")
    build_model_repository(opts, checkpoint, opts.cache_dir / "model_repository")
    install = locate_tritonserver(opts.cache_dir)
    server = TritonServer(install, opts.cache_dir / "model_repository", PIPELINE_MODELS, ports,
                          opts.cache_dir / "logs" / "tritonserver.log", host=opts.triton_host)
    print(f"[serve] starting tritonserver (gRPC {ports.grpc}, HTTP {ports.http}, metrics {ports.metrics}); "
          f"log: {server.log_path}", flush=True)
    server.start()
    server.wait_ready(TRITON_READY_TIMEOUT_S, progress=lambda m: print(m, flush=True))
    return server


def _start_gateway(opts: ServeOptions, triton_url: str, profile: dict[str, object]) -> subprocess.Popen[bytes]:
    import importlib.util  # noqa: PLC0415

    # gateway.serving drains sessions before uvicorn closes the sockets; plain uvicorn is the fallback.
    if importlib.util.find_spec("gateway.serving") is not None:
        cmd = [sys.executable, "-m", "gateway.serving", "--host", opts.host, "--port", str(opts.port)]
    else:
        cmd = [sys.executable, "-m", "uvicorn", "gateway.app:create_app", "--factory", "--host", opts.host,
               "--port", str(opts.port)]
    gateway = subprocess.Popen(cmd, env=gateway_env(triton_url, profile), cwd=REPO_ROOT, start_new_session=True)
    base = f"http://{opts.host}:{opts.port}"
    _wait_gateway(gateway, base, require_ready=opts.only != "gateway")
    print(f"[serve] demo: {base}/  (Ctrl-C stops)", flush=True)
    return gateway


def serve(opts: ServeOptions) -> int:
    """Run until Ctrl-C/SIGTERM (exit 0) or until a child dies (exit 1). Startup errors exit 2."""
    signal.signal(signal.SIGTERM, _raise_stop)
    server: TritonServer | None = None
    gateway: subprocess.Popen[bytes] | None = None
    started = False
    try:
        profile = load_profile(opts.profile)
        if opts.max_sessions is not None:
            profile["max_sessions"] = opts.max_sessions
        ports = opts.triton_ports or choose_triton_ports(opts.port)
        wanted = {} if opts.only == "gateway" else ports.all()
        if opts.only != "triton":
            wanted = {"gateway": opts.port, **wanted}
        check_ports_free(wanted)
        triton_url = opts.triton_url or f"127.0.0.1:{ports.grpc}"
        if opts.only != "gateway":
            server = _start_triton(opts, ports)
        if opts.only != "triton" and _gateway_available():
            gateway = _start_gateway(opts, triton_url, profile)
        elif opts.only != "triton":
            print(f"[serve] gateway.app is not present; Triton serves gRPC at {triton_url}. Ctrl-C stops.", flush=True)
        else:
            print(f"[serve] Triton serves gRPC at {opts.triton_host}:{ports.grpc}. Ctrl-C stops.", flush=True)
        started = True
        while True:
            if server is not None and (server.proc is None or server.proc.poll() is not None):
                raise LaunchError(f"tritonserver stopped unexpectedly; log tail:\n{server.log_tail()}")
            if gateway is not None and gateway.poll() is not None:
                raise LaunchError(f"the gateway exited with code {gateway.returncode}")
            time.sleep(READY_POLL_S)
    except (KeyboardInterrupt, _Stop):
        print("\n[serve] stopping ...", flush=True)
        return 0
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1 if started else 2
    finally:
        if gateway is not None and gateway.poll() is None:
            _signal_group(gateway, signal.SIGTERM)
            try:
                gateway.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(gateway, signal.SIGKILL)
        if server is not None:
            server.stop()
