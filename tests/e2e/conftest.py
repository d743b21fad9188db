"""Fixtures for the end-to-end suite: real stacks (tritonserver + gateway subprocesses).

A module sets `STACK_ENV` (extra DUPLEX_* gateway settings) and `STACK_MODE` ("both" = one `duplex serve`,
"split" = `--only triton` + `--only gateway`, so a test can kill and restart Triton under the gateway).
The profile is DUPLEX_E2E_PROFILE or deploy/profiles/default.yaml; it is printed in the pytest header.

Modules of mode "both" with the same env share one stack (a start costs 15-40 s on 2 cores): it starts for the
first of them and stops, in the background, after the last one collected; each later module gets it only once
it is ready and holds no session (a module that leaked one fails the next one's setup, not silently). A split
stack (its Triton is killed and restarted) and the modules' own fixtures (other profiles, max_sessions 1) stay
their module's alone.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import soundfile as sf
import soxr

from tests.e2e.stack import POLL_S, Stack, profile_path, session_cache, wait_stopped

SPEECH_RATE_HZ = 16000
SENTENCE = "Hello there, could you please tell me about the weather tomorrow?"
E2E_TIMEOUT_S = 90
IDLE_WAIT_S = 30.0  # a shared stack handed to the next module: its sessions closed (grace, cleanup retries)
E2E_DIR = Path(__file__).resolve().parent
StackKey = tuple[str, tuple[tuple[str, str], ...], str]
_USERS: dict[StackKey, set[str]] = {}  # the modules still to run on each shared stack (from the collection)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any("tests/e2e" in str(getattr(r, "fspath", "")) or "tests/e2e" in getattr(r, "nodeid", "")
           for reports in terminalreporter.stats.values() for r in reports):
        terminalreporter.write_line(f"e2e profile: {profile_path()}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


def _stack_key(module: ModuleType) -> StackKey | None:
    """The shared stack a module's `stack` fixture gets; None for a stack of its own (split mode)."""
    mode = getattr(module, "STACK_MODE", "both")
    if mode != "both":
        return None
    profile = getattr(module, "STACK_PROFILE", None) or profile_path()  # a module may serve a profile of its own
    return str(profile), tuple(sorted(getattr(module, "STACK_ENV", {}).items())), mode


def pytest_collection_finish(session: pytest.Session) -> None:
    """Which modules (after -k/-m deselection) will use each shared stack: it stops after the last of them.
    Under pytest-xdist each worker collects every module, so a worker's stack stays until its session ends."""
    _USERS.clear()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or "stack" not in getattr(item, "fixturenames", ()) or E2E_DIR not in item.path.parents:
            continue
        key = _stack_key(module)
        if key is not None:
            _USERS.setdefault(key, set()).add(module.__name__)


@pytest.fixture(scope="session")
def e2e_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir for the session: the tiny checkpoint is generated once, each stack rebuilds its repository."""
    return session_cache(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _background_stops() -> Iterator[None]:
    """Stacks stop on threads of their own (Stack.stop_soon); the session ends after every stop did."""
    yield
    wait_stopped()


def _idle(s: Stack) -> None:
    """The shared stack as the next module must find it: every process up, ready, no session left."""
    t0 = time.monotonic()
    while True:
        dead = [n for n, p in s.procs.items() if not p.alive()]
        held = s.sessions()
        if not dead and held == 0 and s.triton_ready():
            return
        if dead or time.monotonic() - t0 > IDLE_WAIT_S:
            logs = "\n".join(f"--- {n} ---\n{p.tail()}" for n, p in s.procs.items())
            raise RuntimeError(f"the shared stack is not idle for the next module (dead: {dead}, sessions held: "
                               f"{held}) after {time.monotonic() - t0:.0f}s\n{logs}")
        time.sleep(POLL_S)


class _SharedStacks:
    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.stacks: dict[StackKey, Stack] = {}

    def get(self, key: StackKey, env: dict[str, str]) -> Stack:
        s = self.stacks.get(key)
        if s is not None:
            _idle(s)
            return s
        s = Stack(self.cache, profile=Path(key[0]), env=env)
        s.start()  # stops what it started if it fails
        self.stacks[key] = s
        return s

    def release(self, key: StackKey, module: str) -> None:
        users = _USERS.get(key, set())
        users.discard(module)
        if not users and key in self.stacks:
            self.stacks.pop(key).stop_soon()

    def stop_all(self) -> None:
        while self.stacks:
            self.stacks.popitem()[1].stop_soon()


@pytest.fixture(scope="session")
def shared_stacks(e2e_cache: Path, _background_stops: None) -> Iterator[_SharedStacks]:
    pool = _SharedStacks(e2e_cache)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, e2e_cache: Path, shared_stacks: _SharedStacks) -> Iterator[Stack]:
    mod = request.module
    env = dict(getattr(mod, "STACK_ENV", {}))
    key = _stack_key(mod)
    if key is None:
        s = Stack(e2e_cache, env=env, mode=getattr(mod, "STACK_MODE", "both"))
        s.start()
        try:
            yield s
        finally:
            s.stop_soon()
        return
    try:
        yield shared_stacks.get(key, env)
    finally:
        shared_stacks.release(key, mod.__name__)


@pytest.fixture
def addr(stack: Stack) -> str:
    return stack.addr


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """[n] float32 at 16 kHz: espeak-ng's synthetic voice, resampled with soxr."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    wav = Path(tmp_path_factory.mktemp("speech")) / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), SENTENCE], check=True, capture_output=True)
    x, rate = sf.read(wav, dtype="float32")
    return soxr.resample(x, rate, SPEECH_RATE_HZ).astype(np.float32)

