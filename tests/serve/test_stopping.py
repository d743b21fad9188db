"""The launcher's stop signal is held while a child is being created (serve/stopping.py).

A SIGTERM that landed inside `subprocess.Popen` (after the fork, before Popen returned) unwound Popen and left
the child running with nobody holding its pid: tests/e2e/test_launcher.py saw a tritonserver outlive its
launcher that way under load. Here the signal is sent from inside Popen itself, so the race is certain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve.stopping import Stop, held, raise_stop
from serve.tritonserver import TritonInstall, TritonPorts, TritonServer
from tests.ports import free_port


@pytest.fixture
def stop_handler() -> Iterator[None]:
    before = signal.signal(signal.SIGTERM, raise_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _sigterm_inside_popen(monkeypatch: pytest.MonkeyPatch, children: list[subprocess.Popen]) -> None:
    real = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen:
        child = real([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
        children.append(child)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's stop, while Popen has not returned yet
        return child

    monkeypatch.setattr(subprocess, "Popen", popen)


def test_a_stop_inside_popen_is_raised_once_the_server_holds_its_child(
        stop_handler: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    children: list[subprocess.Popen] = []
    _sigterm_inside_popen(monkeypatch, children)
    server = TritonServer(TritonInstall(Path("/bin/true"), tmp_path, ()), tmp_path, ["stage0"],
                          TritonPorts(free_port(), free_port(), free_port()), tmp_path / "triton.log")
    try:
        with pytest.raises(Stop, match="SIGTERM"):
            server.start()
        assert children and server.proc is children[0]  # the launcher's cleanup can stop it
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_stop_outside_a_held_block_is_raised_at_once(stop_handler: None) -> None:
    with pytest.raises(Stop):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes of the main thread
            pass
    ran = []
    with pytest.raises(Stop), held():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        ran.append("the held block ran to its end")
    assert ran == ["the held block ran to its end"]
