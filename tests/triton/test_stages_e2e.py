"""Decoupled, sequence-keyed stage adapters and the `duplex` pipeline through the real tritonserver.

Served with the loopback engines (deploy profile `engine: loopback`): the Triton plumbing is under
test here, not the model. Each request must end with exactly one FINAL response.
"""

from __future__ import annotations

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, UNIT_SAMPLES, TritonSession
from serve.launcher import TritonServer
from tests.triton.talk import StageSession

pytestmark = pytest.mark.e2e
LOUD, QUIET = 0.1, 0.0


def unit(index: int, amp: float) -> np.ndarray:
    return np.full(FIRST_UNIT_SAMPLES if index == 0 else UNIT_SAMPLES, amp, dtype=np.float32)


@pytest.fixture
def sessions(loopback_server: TritonServer, request: pytest.FixtureRequest):
    opened: list[TritonSession] = []

    def make(model: str) -> TritonSession:
        s = TritonSession(loopback_server.grpc_url, model=model)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.mark.parametrize("model", ["stage0", "duplex"])
def test_two_interleaved_sequences_keep_their_own_state(sessions, model: str) -> None:
    a, b = sessions(model), sessions(model)
    assert a.request("open", (1, 1, 0)).of_type("opened")
    assert b.request("open", (1, 1, 0)).of_type("opened")
    # Unit 0 of each session needs 1030 ms: per-sequence state, not a shared counter.
    ra0 = a.request("append", (1, 1, 1), pcm=unit(0, LOUD))
    rb0 = b.request("append", (1, 1, 1), pcm=unit(0, QUIET))
    ra1 = a.request("append", (1, 1, 2), pcm=unit(1, QUIET))
    rb1 = b.request("append", (1, 1, 2), pcm=unit(1, LOUD))
    assert [d["decision"] for d in ra0.of_type("decision") + ra1.of_type("decision")] == ["speak", "listen"]
    assert [d["decision"] for d in rb0.of_type("decision") + rb1.of_type("decision")] == ["listen", "speak"]
    assert [d["unit"] for d in rb0.of_type("unit_done") + rb1.of_type("unit_done")] == [0, 1]
    assert ra0.of_type("text") and not rb0.of_type("text")
    if model == "duplex":
        assert ra0.audio and not rb0.audio and rb1.audio  # PCM only where the session spoke
        assert not ra0.of_type("tts_input")  # stage-to-stage payloads stay inside the pipeline
        assert ra0.events[-1]["type"] == "unit_done"  # audio arrives before the unit ends
    assert a.request("close", (1, 1, 0)).of_type("closed")
    assert b.request("close", (1, 1, 0)).of_type("closed")


@pytest.mark.parametrize("model", ["stage0", "duplex"])
def test_bad_request_fails_only_that_request(sessions, model: str) -> None:
    a, b = sessions(model), sessions(model)
    a.request("open", (1, 1, 0))
    b.request("open", (1, 1, 0))
    bad = a.request("append", (1, 1, 1), pcm=np.zeros(10, np.float32))
    assert [e["code"] for e in bad.of_type("error")] == ["bad_audio"]
    boom = a.request("update", (1, 1, 0), config={"loopback_fail": True})  # raises inside the engine
    assert boom.of_type("error") and boom.of_type("error")[0]["code"] == "internal_error"
    assert b.request("append", (1, 1, 1), pcm=unit(0, LOUD)).of_type("decision")
    assert a.request("append", (1, 1, 2), pcm=unit(0, LOUD)).of_type("decision")  # a still works
    a.request("close", (1, 1, 0))
    b.request("close", (1, 1, 0))


@pytest.mark.parametrize("model", ["stage0", "duplex"])
def test_stale_fence_and_unknown_session_are_typed(sessions, model: str) -> None:
    a, b, ghost = sessions(model), sessions(model), sessions(model)
    a.request("open", (1, 1, 0))
    b.request("open", (1, 1, 0))
    assert a.request("cancel", (1, 1, 0), next_fence=(1, 2, 0)).of_type("cancelled")
    stale = a.request("append", (1, 1, 1), pcm=unit(0, LOUD))
    assert [e["code"] for e in stale.of_type("error")] == ["stale_fence"]
    with pytest.raises(KeyError, match="session_not_found"):  # no START for this sequence on Triton
        ghost.request("append", (1, 1, 1), pcm=unit(0, LOUD))
    assert b.request("append", (1, 1, 1), pcm=unit(0, LOUD)).of_type("unit_done")
    assert a.request("append", (1, 2, 1), pcm=unit(0, LOUD)).of_type("unit_done")
    a.request("close", (1, 2, 0))
    b.request("close", (1, 1, 0))


def test_each_request_ends_with_one_final(loopback_server: TritonServer) -> None:
    """TritonSession.request returns only at FINAL; a second FINAL would leak into the next reply."""
    s = TritonSession(loopback_server.grpc_url, model="duplex")
    try:
        replies = [s.request("open", (1, 1, 0))]
        replies += [s.request("append", (1, 1, i + 1), pcm=unit(i, LOUD)) for i in range(3)]
        replies.append(s.request("close", (1, 1, 0)))
        assert [r.events[0]["type"] for r in replies] == ["opened", "decision", "decision", "decision", "closed"]
        assert [r.of_type("unit_done")[0]["unit"] for r in replies[1:4]] == [0, 1, 2]
    finally:
        s.close()


@pytest.mark.parametrize("model", ["stage0", "tts"])
def test_final_rides_on_the_last_output(loopback_server: TritonServer, model: str) -> None:
    """An engine closes a request right after its last output; the adapter sends them as one response, so a
    request costs the stream one message fewer than with a bare FINAL of its own (P10: the gateway reads every
    message). Best effort by design (the close may come after the response thread took the output), so most
    requests, not all; before, none."""
    s = StageSession(loopback_server.grpc_url, model=model)
    try:
        requests = [s.request("open", (1, 1, 0))]
        if model == "stage0":
            requests += [s.request("append", (1, 1, i + 1), pcm=unit(i, LOUD)) for i in range(8)]
        else:
            requests += [s.request("append", (1, 1, i + 1), tokens=np.arange(4, dtype=np.int64),
                                   config={"unit": i}) for i in range(8)]
        requests.append(s.request("close", (1, 1, 0)))
    finally:
        s.close()
    replies = [r.responses for r in requests]
    for seen in replies:
        assert [final for _, final in seen].count(True) == 1 and seen[-1][1]  # one FINAL, the last response
        assert any(out for out, _ in seen)  # every request answered with its events
    bare = sum(not out for seen in replies for out, final in seen if final)
    assert bare <= len(replies) // 2, f"{bare} of {len(replies)} requests ended with a bare FINAL"
