"""`duplex serve` and CUDA MPS (serve/mps.py): when it starts a private daemon, with which environment, that
tritonserver gets it, and that the daemon is told to quit however the launcher ends.

No GPU here: a stand-in `nvidia-cuda-mps-control` on PATH behaves like the real client (`-d` starts a
"daemon", commands on stdin reach it or fail when none runs) and records every call."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serve import mps
from serve.launcher import load_profile
from serve.mps import CONTROL, LOG_ENV, PIPE_ENV, MpsDaemon, plan_mps, private_daemon, start_daemon
from serve.tritonserver import LaunchError, TritonInstall, TritonPorts, TritonServer, triton_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "deploy" / "profiles"
SERVE_TIMEOUT_S = 25

# The daemon's control socket is stood in for by a file in the pipe dir.
FAKE_CONTROL = """#!{python}
import json, os, pathlib, sys
pipe = pathlib.Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
daemon = pipe / "fake-daemon"
record = {{"argv": sys.argv[1:], "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
          "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY"), "stdin": []}}
code = 0
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_BROKEN"):
        print("fake: cannot open the pipe directory")
        code = 1
    else:
        daemon.touch()
else:
    for line in sys.stdin.read().splitlines():
        record["stdin"].append(line)
        if not daemon.exists():
            print("Cannot find MPS control daemon process")
            code = int(os.environ.get("FAKE_MPS_NO_DAEMON_CODE", "1"))
        elif line == "quit":
            daemon.unlink()
with open({record!r}, "a") as out:
    out.write(json.dumps(record) + "\\n")
sys.exit(code)
"""

FAKE_TRITON = """#!{python}
import json, os
with open({dump!r}, "a") as out:
    out.write(json.dumps({{k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}}) + "\\n")
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


class FakeMps:
    def __init__(self, root: Path) -> None:
        self.bin = root / "fakebin"
        self.bin.mkdir()
        self.record = root / "mps-calls.jsonl"
        self.binary = _script(self.bin / CONTROL, FAKE_CONTROL.format(python=sys.executable, record=str(self.record)))
        self.environ = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.environ.pop(PIPE_ENV, None)
        self.environ.pop(LOG_ENV, None)

    def calls(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def commands(self) -> list[str]:
        """Each call as one word: -d, or the commands it sent."""
        return [" ".join(c["argv"] or c["stdin"]) for c in self.calls()]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeMps:
    monkeypatch.setattr(mps, "FALLBACK_DIRS", ())  # only PATH: a host's real binary must not be found
    return FakeMps(tmp_path)


@pytest.fixture
def cache() -> Iterator[Path]:
    """A serve cache dir short enough for its pipe dir to stay in it (pytest's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="mps-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def no_system_daemon(tmp_path: Path) -> Path:
    return tmp_path / "no-system-mps"


def _cuda(**fields: object) -> dict[str, object]:
    return {"device": "cuda", "stage0_instances": 1, "tts_instances": 1, "token2wav_instances": 1, **fields}


# --- the decision -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,starts", [("default.yaml", False), ("h200.yaml", True), ("h200-scripted.yaml", True),
                                         ("h20.yaml", True), ("h200x2.yaml", True), ("h200x2-scripted.yaml", True)])
def test_shipped_profiles(name: str, starts: bool, fake: FakeMps, no_system_daemon: Path) -> None:
    """The CPU profile runs no daemon; every GPU profile puts two or more stage processes on a GPU (h200x2:
    TTS and Token2Wav on GPU 1) and gets one, read through the launcher's own profile check."""
    plan = plan_mps(load_profile(PROFILES / name), fake.environ, no_system_daemon)
    assert plan.start is starts and plan.required is False
    assert plan.binary == (fake.binary if starts else None)
    assert plan.note is None  # a CPU profile needs no word; a started daemon gets its own line


@pytest.mark.parametrize("fields,per_gpu", [
    ({}, 3),
    ({"gpus": {"stage0": [0], "tts": [1], "token2wav": [2]}}, 1),
    ({"gpus": {"stage0": [0], "tts": [1], "token2wav": [1]}}, 2),
    ({"gpus": {"stage0": [0, 1]}, "stage0_instances": 2}, 4),  # tts and token2wav run on every GPU too
])
def test_stage_processes_per_gpu(fields: dict[str, object], per_gpu: int) -> None:
    assert mps.stage_processes_per_gpu(_cuda(**fields)) == per_gpu


def test_auto_needs_a_shared_gpu(fake: FakeMps, no_system_daemon: Path) -> None:
    alone = _cuda(gpus={"stage0": [0], "tts": [1], "token2wav": [2]})
    plan = plan_mps(alone, fake.environ, no_system_daemon)
    assert not plan.start and "no GPU runs more than one stage process" in str(plan.note)
    assert plan_mps({**alone, "mps": "on"}, fake.environ, no_system_daemon).start  # on: the operator's call


def test_off_starts_nothing(fake: FakeMps, no_system_daemon: Path) -> None:
    plan = plan_mps(_cuda(mps="off"), fake.environ, no_system_daemon)
    assert not plan.start and plan.binary is None and "mps: off" in str(plan.note)
    assert fake.calls() == []


def test_missing_binary(tmp_path: Path, fake: FakeMps, no_system_daemon: Path) -> None:
    bare = {**fake.environ, "PATH": str(tmp_path / "empty")}
    plan = plan_mps(_cuda(), bare, no_system_daemon)  # auto: go on without, and say why
    assert not plan.start and f"{CONTROL} not found" in str(plan.note) and "time-slice" in str(plan.note)
    with pytest.raises(LaunchError) as err:  # on: one clear line
        plan_mps(_cuda(mps="on"), bare, no_system_daemon)
    assert "mps: on" in str(err.value) and CONTROL in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(LaunchError, match="needs device: cuda"):
        plan_mps({"device": "cpu", "mps": "on"}, fake.environ, no_system_daemon)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_operator_daemon_is_used_as_it_is(mode: str, tmp_path: Path, fake: FakeMps, no_system_daemon: Path) -> None:
    theirs = {**fake.environ, PIPE_ENV: str(tmp_path / "their-pipe")}
    plan = plan_mps(_cuda(mps=mode), theirs, no_system_daemon)
    assert not plan.start and str(tmp_path / "their-pipe") in str(plan.note)
    assert fake.calls() == []


def test_system_wide_daemon_is_used_as_it_is(tmp_path: Path, fake: FakeMps) -> None:
    system = tmp_path / "nvidia-mps"
    system.mkdir()
    assert plan_mps(_cuda(), fake.environ, system).start  # a dir alone: no daemon answers there
    (system / "fake-daemon").touch()
    plan = plan_mps(_cuda(), fake.environ, system)
    assert not plan.start and str(system) in str(plan.note)
    assert all(c["pipe"] == str(system) and c["stdin"] == ["get_server_list"] for c in fake.calls())


# --- the daemon ---------------------------------------------------------------------------------------------


def _started(fake: FakeMps, cache: Path, port: int, mode: str = "auto") -> tuple[MpsDaemon | None, list[str]]:
    said: list[str] = []
    plan = plan_mps(_cuda(mps=mode), fake.environ, cache / "no-system")
    daemon = private_daemon(plan, cache, port, fake.environ)
    assert daemon is not None
    return (daemon if start_daemon(daemon, plan, said.append) else None), said


def test_start_and_quit_with_a_private_pipe_dir(cache: Path, fake: FakeMps) -> None:
    daemon, said = _started(fake, cache, 8123)
    assert daemon is not None
    pipe, log = cache / "mps" / "8123" / "pipe", cache / "mps" / "8123" / "log"
    assert daemon.env == {PIPE_ENV: str(pipe), LOG_ENV: str(log)}
    assert said == [f"[serve] MPS on: private control daemon, {PIPE_ENV}={pipe}, {LOG_ENV}={log}"]
    # probe (no leftover daemon), start, probe until it answers
    assert fake.commands() == ["get_server_list", "-d", "get_server_list"]
    launch = fake.calls()[1]
    assert (launch["pipe"], launch["log"]) == (str(pipe), str(log))
    daemon.quit()
    assert fake.calls()[-1] == {"argv": [], "pipe": str(pipe), "log": str(log), "stdin": ["quit"]}
    assert not (pipe / "fake-daemon").exists()


def test_no_daemon_is_told_by_what_the_client_says(cache: Path, fake: FakeMps) -> None:
    """Whatever its exit code, a client that finds no daemon is not taken for one (no stale quit, no skipped wait)."""
    fake.environ["FAKE_MPS_NO_DAEMON_CODE"] = "0"
    daemon, _ = _started(fake, cache, 8129)
    assert daemon is not None
    assert fake.commands() == ["get_server_list", "-d", "get_server_list"]


def test_a_leftover_daemon_is_stopped_first(cache: Path, fake: FakeMps) -> None:
    """A daemon left on this port's pipe dir by a killed `duplex serve` is told to quit, then a fresh one starts."""
    pipe = cache / "mps" / "8124" / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "fake-daemon").touch()
    daemon, _ = _started(fake, cache, 8124)
    assert daemon is not None
    assert fake.commands() == ["get_server_list", "quit", "get_server_list", "-d", "get_server_list"]


def test_a_long_cache_dir_gets_a_short_pipe_dir(tmp_path: Path, fake: FakeMps) -> None:
    cache = tmp_path / ("deep-" * 20)
    daemon, _ = _started(fake, cache, 8125)
    assert daemon is not None
    assert len(str(daemon.pipe_dir)) <= mps.MAX_PIPE_DIR_CHARS and daemon.pipe_dir.is_dir()
    assert daemon.log_dir == cache.resolve() / "mps" / "8125" / "log"  # logs stay with the server's cache
    assert fake.calls()[1]["pipe"] == str(daemon.pipe_dir)
    daemon.quit()
    assert not daemon.pipe_dir.exists()


def test_a_daemon_that_fails_to_start(tmp_path: Path, fake: FakeMps) -> None:
    fake.environ["FAKE_MPS_BROKEN"] = "1"
    daemon, said = _started(fake, tmp_path / "cache", 8126)  # auto: a warning, and on without MPS
    assert daemon is None and len(said) == 1
    assert said[0].startswith("[serve] warning: MPS not started") and "fake: cannot open the pipe directory" in said[0]
    with pytest.raises(LaunchError, match="did not start"):  # on: the launch stops
        _started(fake, tmp_path / "cache", 8127, mode="on")


# --- tritonserver's environment -----------------------------------------------------------------------------


def test_tritonserver_and_its_restarts_get_the_daemon(tmp_path: Path, fake: FakeMps) -> None:
    """The launcher builds the server's environment once (`triton_env(install, daemon.env)`); every start,
    the supervisor's restarts included, hands it to the tritonserver process."""
    daemon, _ = _started(fake, tmp_path / "cache", 8128)
    assert daemon is not None
    dump = tmp_path / "triton-env.jsonl"
    binary = _script(tmp_path / "tritonserver", FAKE_TRITON.format(python=sys.executable, dump=str(dump)))
    install = TritonInstall(binary, tmp_path, ())
    ports = TritonPorts(http=free_port(), grpc=free_port(), metrics=free_port())
    server = TritonServer(install, tmp_path / "repo", [], ports, tmp_path / "triton.log",
                          env=triton_env(install, daemon.env))
    for _ in range(2):  # the first start, then what TritonSupervisor._restart calls
        server.start()
        assert server.proc is not None and server.proc.wait(timeout=10) == 0
    assert [json.loads(line) for line in dump.read_text().splitlines()] == [daemon.env, daemon.env]


def test_an_operator_pipe_dir_reaches_tritonserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PIPE_ENV, str(tmp_path / "their-pipe"))
    assert triton_env(TritonInstall(tmp_path / "tritonserver", tmp_path, ()))[PIPE_ENV] == str(tmp_path / "their-pipe")


# --- through `duplex serve` ---------------------------------------------------------------------------------


def _mps_profile(tmp_path: Path, value: str = "on") -> Path:
    profile = tmp_path / "gpu.yaml"
    profile.write_text((PROFILES / "h200.yaml").read_text() + f"mps: {value}\n")
    return profile


@pytest.fixture
def serve_cmd(tmp_path: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "serve.cli", "serve", "--profile", str(_mps_profile(tmp_path)),
            "--cache-dir", str(cache), "--port", str(free_port())]


def test_serve_quits_the_daemon_after_a_failed_start(tmp_path: Path, cache: Path, fake: FakeMps,
                                                     serve_cmd: list[str]) -> None:
    done = subprocess.run([*serve_cmd, "--checkpoint", str(tmp_path / "no-checkpoint")], env=fake.environ,
                          cwd=REPO, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False)
    assert done.returncode == 2, done.stderr
    assert "has no config.json" in done.stderr and "[serve] MPS on: private control daemon" in done.stdout
    assert fake.commands()[-1] == "quit" and "-d" in fake.commands()
    assert {c["pipe"] for c in fake.calls()} == {str(cache / "mps" / serve_cmd[-1] / "pipe")}


def test_serve_quits_the_daemon_on_sigterm(tmp_path: Path, fake: FakeMps, serve_cmd: list[str]) -> None:
    """SIGTERM while Triton's half is still being prepared (here: the tiny checkpoint being generated)."""
    with subprocess.Popen(serve_cmd, env=fake.environ, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        said = []
        for line in proc.stdout:
            said.append(line)
            if line.startswith("[serve] MPS on"):
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SERVE_TIMEOUT_S) == 0, "".join(said)
    assert "[serve] stopping ...\n" in said
    assert fake.commands()[-1] == "quit"


def test_profile_check_names_a_bad_mps_value(tmp_path: Path) -> None:
    for value, fields in (("maybe", ""), ("on", "device: cpu\n")):
        bad = tmp_path / f"{value}.yaml"
        bad.write_text(f"{fields}mps: {value}\n")
        with pytest.raises(LaunchError, match="'mps' has a bad value") as err:
            load_profile(bad)
        assert "auto, on, off; on needs device: cuda" in str(err.value)
    assert load_profile(_mps_profile(tmp_path, "off"))["mps"] == "off"  # YAML's bare off (false) is read as off
    assert load_profile(PROFILES / "default.yaml")["mps"] == "auto"
