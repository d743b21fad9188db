"""Issue 17 launcher: Triton's ports follow --port (or are picked free), and readiness counts only sockets
held by the launcher's own tritonserver, never another server answering on the same ports."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve.tritonserver import (
    TritonInstall,
    TritonPorts,
    TritonServer,
    choose_triton_ports,
    free_port,
    process_listens_on,
)
from tests import ports

SERVE = "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), " \
        "http.server.BaseHTTPRequestHandler).serve_forever()"


@pytest.fixture
def listener() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = ports.free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port)])
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


def test_ports_follow_the_gateway_port_or_are_picked_free() -> None:
    gw = free_port()
    ports = choose_triton_ports(gw)
    assert gw not in ports.all().values() and len(set(ports.all().values())) == 3
    with socket.socket() as busy:  # one of the derived ports is taken: three free ones instead
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        other = choose_triton_ports(taken - 2)
        assert taken not in other.all().values() and taken - 2 not in other.all().values()


def test_readiness_needs_our_own_process_on_the_ports(listener: tuple[subprocess.Popen[bytes], int],
                                                      tmp_path: Path) -> None:
    proc, port = listener
    assert process_listens_on(proc.pid, port) is True
    install = TritonInstall(Path("/bin/true"), tmp_path, ())
    ours = TritonServer(install, tmp_path, [], TritonPorts(http=port, grpc=port, metrics=free_port()),
                        tmp_path / "t.log")
    bystander = subprocess.Popen(["sleep", "30"])  # "our" server whose bind failed: another answers the port
    try:
        ours.proc = bystander
        assert process_listens_on(bystander.pid, port) is False
        assert not ours.owns_ports()
        ours.proc = proc
        assert ours.owns_ports()
    finally:
        ours.proc = None
        bystander.kill()
        bystander.wait()
