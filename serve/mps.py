"""CUDA MPS for `duplex serve`: a private control daemon, so the stage processes' kernels overlap on a GPU.

Triton runs stage0, TTS and Token2Wav as separate Python-backend stub processes. On one GPU without MPS
the GPU time-slices between them and each step takes about twice as long as alone; under MPS their kernels
run side by side. Measured on the H200 (bench/RESULTS.md, "The served figure on the H200"): 8 sessions went
from not held (commit→first audio p99 2558 ms) to held (p99 532 ms).

The daemon is private: its own pipe directory under the serve cache dir, started by `duplex serve` before
tritonserver, told to `quit` when `duplex serve` ends. It changes no GPU setting (compute mode stays as it
is). A daemon the operator already runs (CUDA_MPS_PIPE_DIRECTORY set, or the system-wide one in
/tmp/nvidia-mps) is used as it is and nothing is started.

This module imports neither torch nor `engine` (it runs in the gateway image too); it only manages processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.tritonserver import LaunchError

MODES = ("auto", "on", "off")
CONTROL = "nvidia-cuda-mps-control"
# Where the driver's tools live when they are not on PATH (NVIDIA's container toolkit, distro packages).
FALLBACK_DIRS = (Path("/usr/local/nvidia/bin"), Path("/usr/bin"))
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SYSTEM_PIPE_DIR = Path("/tmp/nvidia-mps")  # where CUDA looks for a daemon when PIPE_ENV is unset
# MPS puts unix sockets in the pipe dir; a socket path holds at most ~107 bytes, so leave room for the names.
MAX_PIPE_DIR_CHARS = 80
SHORT_DIR_ROOT = Path("/tmp")
STAGES = ("stage0", "tts", "token2wav")
NO_DAEMON = "cannot find mps control daemon"
COMMAND_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 10.0
POLL_S = 0.1

Say = Callable[[str], None]


@dataclass(frozen=True)
class MpsPlan:
    """What `duplex serve` does about MPS: start a private daemon with `binary`, or not. `required`: a daemon
    that fails to start stops the launch (mps: on); otherwise it is a warning. `note`: the line to log."""
    start: bool
    required: bool = False
    binary: Path | None = None
    note: str | None = None


def find_control(path: str | None) -> Path | None:
    """nvidia-cuda-mps-control on `path` (a PATH value), else in FALLBACK_DIRS."""
    found = shutil.which(CONTROL, path=path)
    if found:
        return Path(found)
    for folder in FALLBACK_DIRS:
        if os.access(folder / CONTROL, os.X_OK):
            return folder / CONTROL
    return None


def stage_processes_per_gpu(profile: Mapping[str, Any]) -> int:
    """The most stage processes one GPU runs: every instance of a stage model is a stub process of its own.
    A stage whose GPUs the profile does not name (`gpus`) has its instances on every visible GPU."""
    gpus = profile.get("gpus") or {}
    pinned: Counter[int] = Counter()
    everywhere = 0
    for stage in STAGES:
        count = int(profile.get(f"{stage}_instances", 1))
        for gpu in gpus.get(stage) or ():
            pinned[gpu] += count
        if not gpus.get(stage):
            everywhere += count
    return everywhere + max(pinned.values(), default=0)


def plan_mps(profile: Mapping[str, Any], environ: Mapping[str, str],
             system_pipe_dir: Path = SYSTEM_PIPE_DIR) -> MpsPlan:
    """Decide from the deploy profile (`mps`, `device`, instances, `gpus`) and the environment. Raises
    LaunchError for `mps: on` where no daemon can be started."""
    mode = profile.get("mps", "auto")
    if mode not in MODES:
        raise LaunchError(f"deploy profile field 'mps' has a bad value {mode!r} ({', '.join(MODES)})")
    on_cuda = str(profile.get("device", "cpu")).startswith("cuda")
    if mode == "off":
        return MpsPlan(False, note="[serve] MPS off (deploy profile: mps: off)" if on_cuda else None)
    if not on_cuda:
        if mode == "on":
            raise LaunchError("deploy profile mps: on needs device: cuda")
        return MpsPlan(False)
    binary = find_control(environ.get("PATH"))
    running = _operator_daemon(binary, environ, system_pipe_dir)
    if running is not None:
        return MpsPlan(False, note=f"[serve] MPS: using the daemon already running at {running}; starting none")
    shared = stage_processes_per_gpu(profile)
    if mode == "auto" and shared < 2:
        return MpsPlan(False, note="[serve] MPS off: no GPU runs more than one stage process")
    if binary is None:
        where = f"PATH, {', '.join(str(d) for d in FALLBACK_DIRS)}"
        if mode == "on":
            raise LaunchError(f"deploy profile mps: on, but {CONTROL} was not found ({where})")
        return MpsPlan(False, note=f"[serve] MPS off: {CONTROL} not found ({where}); the {shared} stage processes "
                                   f"on one GPU time-slice it")
    return MpsPlan(True, required=mode == "on", binary=binary)


def _operator_daemon(binary: Path | None, environ: Mapping[str, str], system_pipe_dir: Path) -> str | None:
    """The pipe dir of an MPS daemon the operator runs: CUDA_MPS_PIPE_DIRECTORY as given, or the system-wide
    daemon (CUDA clients join it by default, so a second daemon beside it would only compete)."""
    if environ.get(PIPE_ENV):
        return f"{environ[PIPE_ENV]} ({PIPE_ENV})"
    if binary is not None and system_pipe_dir.is_dir() and _answers(binary, system_pipe_dir, environ):
        return str(system_pipe_dir)
    return None


def _control(binary: Path, command: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str] | None:
    """Send one command to the daemon of env[PIPE_ENV]; None when the client itself hung or could not run."""
    try:
        return subprocess.run([str(binary)], input=f"{command}\n", env=dict(env), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _answers(binary: Path, pipe_dir: Path, environ: Mapping[str, str]) -> bool:
    """A daemon listens on `pipe_dir`. The control client says "Cannot find MPS control daemon process" when
    none does; its exit code is checked too."""
    done = _control(binary, "get_server_list", {**environ, PIPE_ENV: str(pipe_dir)})
    return done is not None and done.returncode == 0 and NO_DAEMON not in (done.stdout + done.stderr).lower()


@dataclass
class MpsDaemon:
    """One private MPS control daemon. `env` goes to tritonserver (and its restarts, which keep the daemon)."""
    binary: Path
    pipe_dir: Path
    log_dir: Path
    environ: Mapping[str, str]
    own_pipe_dir: bool = False  # a short /tmp dir made for this daemon: removed after quit

    @property
    def env(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    @classmethod
    def at(cls, binary: Path, cache_dir: Path, port: int, environ: Mapping[str, str]) -> MpsDaemon:
        """A daemon (not started yet) with its dirs under `cache_dir`/mps/`port`: one per server on a host."""
        root = cache_dir.resolve() / "mps" / str(port)
        return cls(binary, root / "pipe", root / "log", environ)

    def start(self) -> None:
        """Start it and wait until it answers; raises LaunchError when it does not."""
        try:
            self._make_dirs()
        except OSError as exc:
            raise LaunchError(f"cannot make the MPS directories: {exc}") from exc
        if self.answers():
            # left by an earlier `duplex serve` on this port that was killed (its ports are free again)
            self._send_quit()
            self._wait(answering=False)
        self._launch()

    def _make_dirs(self) -> None:
        if len(str(self.pipe_dir)) > MAX_PIPE_DIR_CHARS:
            port = self.pipe_dir.parent.name
            self.pipe_dir = Path(tempfile.mkdtemp(prefix=f"duplex-mps-{port}-", dir=SHORT_DIR_ROOT))
            self.own_pipe_dir = True
        for folder in (self.pipe_dir, self.log_dir):
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    def answers(self) -> bool:
        return _answers(self.binary, self.pipe_dir, self.environ)

    def quit(self) -> None:
        """Stop the daemon (its MPS server exits with it); call after tritonserver has stopped."""
        self._send_quit()
        if self.own_pipe_dir:
            self._wait(answering=False)
            shutil.rmtree(self.pipe_dir, ignore_errors=True)

    def _launch(self) -> None:
        out_path = self.log_dir / "start.out"
        try:
            with open(out_path, "wb") as out:
                # A file, not a pipe, for its output: the forked daemon keeps the descriptors. Own session: a
                # Ctrl-C at the terminal must not reach it before tritonserver is down.
                code = subprocess.run([str(self.binary), "-d"], env={**self.environ, **self.env},
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, timeout=COMMAND_TIMEOUT_S, check=False).returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(f"the MPS control daemon did not start: {exc}") from exc
        if code == 0 and self._wait(answering=True):
            return
        said = out_path.read_text(errors="replace").strip().splitlines()
        why = said[-1] if said else f"see {self.log_dir}"
        raise LaunchError(f"the MPS control daemon did not start ({CONTROL} -d exited with code {code}): {why}")

    def _send_quit(self) -> None:
        _control(self.binary, "quit", {**self.environ, **self.env})

    def _wait(self, answering: bool) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.answers() != answering:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True


def private_daemon(plan: MpsPlan, cache_dir: Path, port: int, environ: Mapping[str, str]) -> MpsDaemon | None:
    """The daemon `plan` asks for, not started yet, or None."""
    if not plan.start or plan.binary is None:
        return None
    return MpsDaemon.at(plan.binary, cache_dir, port, environ)


def start_daemon(daemon: MpsDaemon, plan: MpsPlan, say: Say) -> bool:
    """Start `daemon` and log where it is. A daemon that fails to start is a warning (False) unless `plan`
    requires it (mps: on: LaunchError)."""
    try:
        daemon.start()
    except LaunchError as exc:
        daemon.quit()  # a half-started one, and its short /tmp dir
        if plan.required:
            raise
        say(f"[serve] warning: MPS not started, going on without it (the stage processes time-slice the GPU): {exc}")
        return False
    say(f"[serve] MPS on: private control daemon, {PIPE_ENV}={daemon.pipe_dir}, {LOG_ENV}={daemon.log_dir}")
    return True
