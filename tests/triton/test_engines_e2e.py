"""The real engine/ stage engines behind tritonserver (tiny checkpoint, CPU, default deploy profile).

Sessions go through `duplex` the way the gateway drives it (one stream per session, each request
awaited in order). Random tiny weights make decisions random: sessions open with force_listen_count 0
and fixed seeds, and the assertions are on structure and on isolation, not on particular tokens.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from clients.triton_example import FIRST_UNIT_SAMPLES, UNIT_SAMPLES, Reply, TritonSession
from serve.launcher import TritonServer

from .talk import Run, StageSession, run_session, session_config, spoken_pcm

pytestmark = pytest.mark.e2e
SEED_A, SEED_B = 0, 1
OUTPUT_SAMPLES_PER_UNIT = 24_000  # one 1 s speak unit of 24 kHz PCM
PCM_TOLERANCE = 2  # int16 LSBs: batching other sessions' rows may round the flow differently


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    pcm = spoken_pcm(tmp_path_factory.mktemp("wav"))
    assert pcm.size > FIRST_UNIT_SAMPLES + UNIT_SAMPLES  # at least three units of speech
    return pcm


def unit(index: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + index)
    return (rng.standard_normal(FIRST_UNIT_SAMPLES if index == 0 else UNIT_SAMPLES) * 0.1).astype(np.float32)


def check_unit_reply(reply: Reply, index: int) -> None:
    """decision, text…, audio…, unit_done (last); PCM only where the unit spoke; metrics for the gateway."""
    kinds = [e["type"] for e in reply.events]
    assert kinds[0] == "decision" and kinds[-1] == "unit_done", kinds
    decision, done = reply.events[0], reply.events[-1]
    assert decision["unit"] == done["unit"] == index
    assert not set(kinds) - {"decision", "text", "audio", "unit_done"}  # stage payloads stay inside
    assert kinds.index("audio") > max(i for i, k in enumerate(kinds) if k in ("decision", "text")) \
        if "audio" in kinds else True
    thinker = done["metrics"]["thinker"]
    assert thinker["tokens"] >= 1 and len(thinker["token_times_ms"]) == thinker["tokens"]
    if decision["action"] == "speak":
        assert not done["is_listen"]
        assert bool(reply.of_type("text")) == bool(done["text"])  # a unit may stop before any text
        # A unit renders at most its 25 codes (1 s); the TTS may stop early on EOS at a turn's start.
        assert sum(a.size for a in reply.audio) <= OUTPUT_SAMPLES_PER_UNIT
        assert all(a.dtype == np.int16 for a in reply.audio)
        talker = done["metrics"]["talker"]
        assert talker["from_unit_ms"] >= talker["first_output_ms"] > 0  # from the append / from the TTS's input
        if reply.audio:
            code2wav = done["metrics"]["code2wav"]
            assert code2wav["from_unit_ms"] >= talker["from_unit_ms"] + code2wav["first_output_ms"] > 0
    else:
        assert done["is_listen"] and not reply.audio


def check_run(run: Run) -> None:
    assert run.opened.of_type("opened") and run.closed.of_type("closed")
    for i, reply in enumerate(run.units):
        check_unit_reply(reply, i)
    assert "speak" in run.decisions()  # these seeds speak (force_listen_count 0)
    assert run.pcm().size  # and some of it is rendered


def test_spoken_wav_two_concurrent_sessions_are_isolated(torch_server: TritonServer, speech: np.ndarray) -> None:
    alone = run_session(torch_server.grpc_url, speech, SEED_A)
    check_run(alone)
    runs: dict[str, Run] = {}

    def talk(name: str, pcm: np.ndarray, seed: int) -> None:
        runs[name] = run_session(torch_server.grpc_url, pcm, seed)

    threads = [threading.Thread(target=talk, args=("a", speech, SEED_A)),
               threading.Thread(target=talk, args=("b", speech[::-1].copy(), SEED_B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(runs) == ["a", "b"]
    check_run(runs["a"])
    check_run(runs["b"])
    # Session A's outputs do not depend on B sharing the engines' batches.
    assert runs["a"].decisions() == alone.decisions()
    assert runs["a"].tokens() == alone.tokens()
    a_pcm, alone_pcm = runs["a"].pcm().astype(np.int32), alone.pcm().astype(np.int32)
    assert a_pcm.shape == alone_pcm.shape
    assert np.abs(a_pcm - alone_pcm).max() <= PCM_TOLERANCE
    assert runs["b"].tokens() != alone.tokens()  # B really is another session (seed, audio)


def test_forced_listen_units_are_marked_and_silent(torch_server: TritonServer) -> None:
    run = run_session(torch_server.grpc_url, np.concatenate([unit(i) for i in range(3)])[:FIRST_UNIT_SAMPLES + 2 *
                      UNIT_SAMPLES], SEED_A, force_listen_count=2)
    for i, reply in enumerate(run.units):
        check_unit_reply(reply, i)
    assert run.decisions()[:2] == ["listen", "listen"]
    assert [r.events[0]["forced"] for r in run.units] == [True, True, False]
    assert all(r.events[-1]["forced"] for r in run.units[:2])


@pytest.fixture
def sessions(torch_server: TritonServer):
    opened: list[TritonSession] = []

    def make(model: str = "duplex") -> TritonSession:
        s = (TritonSession if model == "duplex" else StageSession)(torch_server.grpc_url, model=model)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def test_stale_fence_and_unknown_session_are_typed(sessions) -> None:
    a, b, ghost = sessions(), sessions(), sessions()
    assert a.request("open", (1, 1, 0), config=session_config(SEED_A)).of_type("opened")
    assert b.request("open", (1, 1, 0), config=session_config(SEED_B)).of_type("opened")
    check_unit_reply(a.request("append", (1, 1, 1), pcm=unit(0)), 0)
    assert a.request("cancel", (1, 1, 1), next_fence=(1, 2, 0)).of_type("cancelled")
    stale = a.request("append", (1, 1, 2), pcm=unit(1))
    assert [e["code"] for e in stale.events] == ["stale_fence"]
    with pytest.raises(KeyError, match="session_not_found"):  # no START for this sequence on Triton
        ghost.request("append", (1, 1, 1), pcm=unit(0))
    check_unit_reply(b.request("append", (1, 1, 1), pcm=unit(0)), 0)  # b is untouched
    # a goes on in its new epoch; append_seq runs on across epochs (the gateway's Fence.next keeps it)
    check_unit_reply(a.request("append", (1, 2, 2), pcm=unit(1)), 1)
    assert a.request("close", (1, 2, 0)).of_type("closed")
    assert b.request("close", (1, 1, 0)).of_type("closed")


def test_failing_requests_fail_only_themselves(sessions) -> None:
    a, b = sessions(), sessions()
    a.request("open", (1, 1, 0), config=session_config(SEED_A))
    b.request("open", (1, 1, 0), config=session_config(SEED_B))
    assert [e["code"] for e in a.request("append", (1, 1, 1), pcm=np.zeros(10, np.float32)).events] == ["bad_audio"]
    bad_cfg = a.request("update", (1, 1, 0), config={"temperature": "hot"})
    assert [e["code"] for e in bad_cfg.of_type("error")] == ["invalid_runtime_config"]
    check_unit_reply(b.request("append", (1, 1, 1), pcm=unit(0)), 0)
    check_unit_reply(a.request("append", (1, 1, 2), pcm=unit(0)), 0)  # a's session survived both
    a.request("close", (1, 1, 0))
    b.request("close", (1, 1, 0))


def test_engine_exception_fails_only_that_request(sessions) -> None:
    """An exception raised while the tts engine thread handles one request (`is_turn_eos` not a list)."""
    a, b = sessions("tts"), sessions("tts")
    a.request("open", (1, 1, 0), config={"seed": 1})
    b.request("open", (1, 1, 0), config={"seed": 2})
    rows = np.arange(3, dtype=np.int64)
    hidden = np.zeros(3 * 128, np.float32)  # tiny llm_dim
    boom = a.request("append", (1, 1, 1), tokens=rows, hidden=hidden, config={"unit": 0, "is_turn_eos": 5})
    assert [e["code"] for e in boom.events] == ["internal_error"]
    ok = {"unit": 0, "is_turn_eos": [False] * 3, "turn_start": True}
    assert b.request("append", (1, 1, 1), tokens=rows, hidden=hidden, config=ok).of_type("audio_tokens")
    assert a.request("append", (1, 1, 2), tokens=rows, hidden=hidden, config=ok).of_type("audio_tokens")
    a.request("close", (1, 1, 0))
    b.request("close", (1, 1, 0))
