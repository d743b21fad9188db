"""Start the real tritonserver on this machine and wait until its models are ready.

On a plain machine the binary, the Python backend and its per-Python-version stubs come from the
`nvidia-pytriton` wheel; inside NVIDIA's Triton container `tritonserver` is on PATH with its own
backends. The Python backend wants its stub next to `libtriton_python.so`, and the stub (which links
Debian's libpython3.11) must find torch and the project through PYTHONPATH, so we lay out a private
backend folder under the cache dir and hand the server a prepared environment.

This module imports neither torch nor `engine` (it runs in the gateway image too); it only manages processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from serve.stopping import held

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache"
STUB_NAME = "triton_python_backend_stub"
READY_POLL_S = 0.25
PROGRESS_EVERY_S = 3.0
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 40
MAX_PORT = 65535
SHM_PREFIX = "triton_python_backend_shm_region_"  # the Python backend's per-instance regions in /dev/shm
SHM_DIR = Path("/dev/shm")
CAUSE_LINES = 12
# Lines of a tritonserver log that say why it failed (the model table and INFO chatter do not).
ERROR_KEYS = ("failed to load", "failed to start", "already in use", "error:", "Error", "Traceback", "Fatal",
              "Segmentation fault", "Aborted", "Killed", "out of memory")
# Python-backend shared memory per model instance. The 1 MiB default grows under concurrent
# decoupled BLS traffic; start large enough that one second of audio per session never grows it.
PY_SHM_DEFAULT_BYTES = 64 * 1024 * 1024
PY_SHM_GROWTH_BYTES = 16 * 1024 * 1024
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's compiled graphs, and its Triton kernels beneath them
COMPILE_CACHE_NAME = "torch-compile"


# A model's progress in tritonserver's log: its load ("successfully loaded 'tts'") and the stages' own notes,
# which the adapter logs as `"<stage>: <note>"` (warm-up steps: engine/warmup.py Progress).
LOADED_LINE = re.compile(r"successfully loaded '([\w.-]+)'")
STAGE_NOTE_LINE = re.compile(r'\] "([\w.-]+): (.+)"$')


def load_progress(log_lines: Iterable[str], models: Sequence[str]) -> dict[str, str]:
    """Each model's state as the server's log tells it: `loaded`, else the stage's last warm-up note
    ("warm-up 12/180"), else `loading`. tritonserver answers HTTP only once the models it was started with
    have loaded, so until then the log is all there is to show (a cold GPU start compiles for minutes)."""
    states = dict.fromkeys(models, "loading")
    for line in log_lines:
        if loaded := LOADED_LINE.search(line):
            if loaded[1] in states:
                states[loaded[1]] = "loaded"
        elif (note := STAGE_NOTE_LINE.search(line)) and "warm-up" in note[2] and note[1] in states:
            if states[note[1]] != "loaded":  # "tts warm-up 7/18: compiled step ... (2.2 s)" -> "warm-up 7/18"
                states[note[1]] = note[2].removeprefix(f"{note[1]} ").split(":")[0].split(" (")[0]
    return states


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


def compile_cache_env(cache_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The stages' torch.compile output under the cache dir, which docker-compose.yml and the k8s manifest keep in
    a volume: a restarted container loads its kernels instead of compiling them again (the H200 profile: /ready
    after 31 s with a warm cache against 121 s cold, bench/RESULTS.md stop 31). inductor's default is under /tmp,
    which a container loses. A TORCHINDUCTOR_CACHE_DIR already set is kept; an empty one, which torch would read
    as the working directory (the repository root, for the stubs), counts as unset."""
    if environ.get(COMPILE_CACHE_ENV):
        return {}
    return {COMPILE_CACHE_ENV: str((cache_dir / COMPILE_CACHE_NAME).resolve())}


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def choose_triton_ports(gateway_port: int) -> TritonPorts:
    """Triton's three ports, derived from the gateway's (`--port`+1..+3: 8001-8003 for 8000) so that servers
    with different `--port` never collide; if one of those is taken, three free ports the kernel picks."""
    derived = TritonPorts(http=gateway_port + 1, grpc=gateway_port + 2, metrics=gateway_port + 3)
    if derived.metrics <= MAX_PORT and not any(port_in_use(p) for p in derived.all().values()):
        return derived
    picked: list[int] = []
    while len(picked) < 3:
        port = free_port()
        if port not in picked and port != gateway_port:
            picked.append(port)
    return TritonPorts(http=picked[0], grpc=picked[1], metrics=picked[2])


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
        self.shm_regions: set[str] = set()

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
        # a launcher's stop signal inside Popen would leave tritonserver running unheld (serve/stopping.py)
        with open(self.log_path, "wb") as log, held():
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env or triton_env(self.install), start_new_session=True,
            )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def load_errors(self) -> list[str]:
        """Lines of the log that name a failing model or port (what a person needs to see)."""
        return [ln.strip() for ln in self.log_lines() if any(k in ln for k in ERROR_KEYS)]

    def exit_cause(self, code: int, lines: int = CAUSE_LINES) -> str:
        """Why the process ended: the signal or exit code and the log's last error lines (never the model
        table, which Triton prints at every start and exit and which says nothing about a crash)."""
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        errors = [ln for ln in self.load_errors() if not ln.startswith(("|", "+"))][-lines:]
        detail = "\n  ".join(errors) if errors else "(no error lines in its log)"
        return f"tritonserver {how}; last error lines:\n  {detail}\n(full log: {self.log_path})"

    def owns_ports(self) -> bool:
        """The HTTP and gRPC ports are held by THIS process: another server answering on them (a second
        launcher whose Triton failed to bind) must not pass for ours."""
        if self.proc is None:
            return False
        return all(process_listens_on(self.proc.pid, p) is not False for p in (self.ports.http, self.ports.grpc))

    def note_shm_regions(self) -> None:
        """Remember the Python backend's /dev/shm regions this server maps (read while it is alive)."""
        if self.proc is not None and self.proc.poll() is None:
            self.shm_regions |= mapped_shm_regions(self.proc.pid)

    def remove_shm_regions(self) -> list[str]:
        """Unlink the regions a dead server left (a killed server cannot remove its own). Returns them."""
        removed = []
        for name in sorted(self.shm_regions):
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
                removed.append(name)
        self.shm_regions.clear()
        return removed

    def model_states(self) -> dict[str, str]:
        try:
            index = _http_json(f"{self.http_url}/v2/repository/index", method="POST", body=b"{}")
        except (OSError, ValueError):
            return {}
        return {m["name"]: f'{m.get("state", "?")}{": " + m["reason"] if m.get("reason") else ""}' for m in index}

    def is_ready(self) -> bool:
        return all(http_ok(f"{self.http_url}/v2/models/{m}/ready") for m in self.models) and http_ok(
            f"{self.http_url}/v2/health/ready") and self.owns_ports()

    def wait_ready(self, timeout_s: float, progress: Callable[[str], None] = print) -> None:
        assert self.proc is not None, "start() first"
        t0 = last = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LaunchError(self._exit_message(code))
            if self.is_ready():
                self.note_shm_regions()
                progress(f"[triton] ready in {time.monotonic() - t0:.1f}s: {', '.join(self.models)}")
                return
            now = time.monotonic()
            if now - t0 > timeout_s:
                states = self.model_states() or load_progress(self.log_lines(), self.models)
                self.stop()
                raise LaunchError(f"tritonserver not ready after {timeout_s:.0f}s; model states: {states}\n"
                                  f"log tail ({self.log_path}):\n{self.log_tail()}")
            if now - last >= PROGRESS_EVERY_S:
                states = self.model_states() or load_progress(self.log_lines(), self.models)
                progress(f"[triton] waiting ({now - t0:.0f}s): " + ", ".join(f"{k}={v}" for k, v in states.items()))
                last = now
            time.sleep(READY_POLL_S)

    def _exit_message(self, code: int) -> str:
        return f"{self.exit_cause(code)} (during startup)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[str]:
        """SIGTERM, then SIGKILL after `grace_s`, to the whole group (the backend stubs too); then remove
        the shared-memory regions a killed server leaves behind. Returns the regions removed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return []
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        signal_group(proc, signal.SIGKILL)  # stubs that outlived their server (it crashed) hold regions mapped
        return self.remove_shm_regions()

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on `port` (IPv4 and IPv6); None where /proc/net is not there."""
    found: set[str] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not any(t.exists() for t in tables):
        return None
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                    found.add(f[9])
    return found


def process_listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on `port` (None: cannot tell on this system)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:[") and link[len("socket:["):-1] in inodes:
                return True
    return False


def mapped_shm_regions(pid: int) -> set[str]:
    """Names of the Python backend's /dev/shm regions mapped by process `pid`."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    prefix = f"{SHM_DIR}/{SHM_PREFIX}"
    return {line[line.index(prefix):].split()[0].rsplit("/", 1)[1] for line in maps.splitlines() if prefix in line}


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _http_json(url: str, method: str = "GET", body: bytes | None = None) -> list[dict[str, str]]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=2.0) as resp:
        return json.loads(resp.read())
