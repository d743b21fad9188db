"""Many real-engine sessions through `duplex` on three streams at once: the pipeline's stubs must survive.

Regression test for the 2.51 stub's decoupled-BLS defect (docs/triton.md "BLS pitfalls"): a BLS response
arriving while the pipeline ran Python corrupted the stub's heap. Before the stages answered the pipeline
with one coalesced response, this load killed a `duplex` stub in 4 of 5 runs here. The tests run on their
own server so that a dead stub cannot take other tests with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, UNIT_SAMPLES, TritonSession
from serve.launcher import TritonInstall, TritonServer

from .conftest import start_server
from .talk import pipelined, run_session, session_config

pytestmark = pytest.mark.e2e
# What a dying Python-backend stub leaves in the server log.
CRASH_MARKS = ("corrupted size", "Reference count error", "not healthy", "double linked list", "fastbin",
               "malloc()", "Segmentation fault", "double free")
SESSIONS_PER_CLIENT = 8  # sequential sessions per stream
CLIENTS = 3  # concurrent streams
REPLY_TIMEOUT_S = 15.0  # a dead stub leaves requests unanswered: fail fast instead of waiting a minute


@pytest.fixture(scope="module")
def server(triton_install: TritonInstall, torch_repo: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TritonServer]:
    srv = start_server(triton_install, torch_repo, tmp_path_factory.mktemp("stress") / "triton.log")
    try:
        yield srv
    finally:
        srv.stop()
    # the unload too: objects the pipeline still held at exit once segfaulted every duplex stub there
    assert not crashes(srv), Path(srv.log_path).read_text(errors="replace")[-3000:]


def crashes(server: TritonServer) -> list[str]:
    """The crash marks found in the server log."""
    log = Path(server.log_path).read_text(errors="replace")
    return [mark for mark in CRASH_MARKS if mark in log]


def run_clients(client: Callable[[int], None], seed_step: int) -> list[BaseException]:
    """`client(seed)` on CLIENTS threads at once; what they raised."""
    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            client(seed)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(seed_step * c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    return errors


def unit(index: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + index)
    return (rng.standard_normal(FIRST_UNIT_SAMPLES if index == 0 else UNIT_SAMPLES) * 0.1).astype(np.float32)


def test_gateway_style_traffic_keeps_the_pipeline_healthy(server: TritonServer) -> None:
    """Many short sessions on three streams at once, each request awaited: the perf_analyzer crash
    pattern (a sequence reused before its previous one ended) cannot happen, and the stubs stay up."""
    def client(seed: int) -> None:
        for k in range(SESSIONS_PER_CLIENT):
            run = run_session(server.grpc_url, np.concatenate([unit(0, k), unit(1, k)]), seed + k,
                              timeout_s=REPLY_TIMEOUT_S)
            assert len(run.units) == 2 and run.closed.of_type("closed")

    errors = run_clients(client, 100)
    assert not errors, errors
    assert server.is_ready()
    assert not crashes(server)


def test_requests_sent_back_to_back_on_a_sequence(server: TritonServer) -> None:
    """perf_analyzer's pattern: every request of a session sent without waiting for the previous one's
    FINAL. The sequence batcher queues them; each still ends with exactly one FINAL, in order."""
    def client(seed: int) -> None:
        session = TritonSession(server.grpc_url, model="duplex")
        for k in range(SESSIONS_PER_CLIENT):
            replies = pipelined(session, [("open", (1, 1, 0), {"config": session_config(seed + k)}),
                                          ("append", (1, 1, 1), {"pcm": unit(0, k)}),
                                          ("append", (1, 1, 2), {"pcm": unit(1, k)}),
                                          ("close", (1, 1, 0), {})], timeout_s=REPLY_TIMEOUT_S)
            session.corrid += 1  # the next session is a new sequence on the same stream
            assert [r.events[0]["type"] for r in replies] == ["opened", "decision", "decision", "closed"]
            assert [r.events[-1]["unit"] for r in replies[1:3]] == [0, 1]
        session.close()

    errors = run_clients(client, 1000)
    assert not errors, errors
    assert not crashes(server)
