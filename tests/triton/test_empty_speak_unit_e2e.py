"""A speak unit with zero TTS rows through the real tritonserver (model.md §3.7 Q11), on both served paths.

Tiny checkpoint on CPU; stage0 on tests/e2e/profiles/scripted.yaml's plan with `text_ids_per_unit: 0`, so each
turn's first speak unit is `<|speak|><|chunk_eos|>` (no TTS rows) and its second `<|speak|><|turn_eos|><|chunk_eos|>`.
Sessions open with `force_listen_count` 0: units 0 and 3 listen, 1 and 4 are empty speak units, 2 and 5 end the
turn. The empty units' `tts_input` carries zero-length TOKENS (and no HIDDEN) over gRPC (the gateway's chain) and
over BLS (the `duplex` pipeline); each must come back as Token2Wav speech, not as nothing (the gateway's 1 s of
silence is then never needed for them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.triton_example import TritonSession
from gateway.runtime.base import AudioPiece, Decision, SessionKey, UnitDone
from gateway.runtime.stages import StagedTritonRuntime
from serve.launcher import TritonInstall, TritonServer
from tests.e2e.stack import stop_soon

from .conftest import ALL_MODELS, REPO_ROOT, DeployProfile, build_repository, start_server
from .test_staged_e2e import _session

pytestmark = pytest.mark.e2e
PLAN = {"listen_units": 1, "speak_units": 2, "text_ids_per_unit": 0, "tail_listen_units": 0}
FIRST_UNIT, UNIT = 16_480, 16_000
UNITS = 6
EMPTY_UNITS, TURN_ENDS = (1, 4), (2, 5)
UNIT_SAMPLES = 24_000  # a steady speak unit (model.md §6.6)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(triton_install: TritonInstall, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
           background_stops: None) -> Iterator[TritonServer]:
    profile = DeployProfile.load(REPO_ROOT / "tests" / "e2e" / "profiles" / "scripted.yaml",
                                 engine_options={"stage0": {"scripted_decisions": PLAN}})
    repo = build_repository(str(tiny_checkpoint), profile, tmp_path_factory.mktemp("empty-unit") / "models")
    srv = start_server(triton_install, repo, tmp_path_factory.mktemp("empty-unit-log") / "triton.log",
                       models=ALL_MODELS)
    try:
        yield srv
    finally:
        stop_soon(srv.stop, "empty-unit-server")  # graceful, while the next tests run


def _pcm(index: int) -> np.ndarray:
    rng = np.random.default_rng(700 + index)
    return (rng.standard_normal(FIRST_UNIT if index == 0 else UNIT) * 0.1).astype(np.float32)


def _check_unit_audio(unit: int, pcm: np.ndarray) -> None:
    if unit in EMPTY_UNITS:  # the turn's first unit: 25 codes -> one 28-code call, 3840 zeros + speech
        assert pcm.size == UNIT_SAMPLES and np.any(pcm != 0), (unit, pcm.size)
    else:  # the turn's end: the buffer's rest, flushed
        assert pcm.size > 0, unit


async def test_the_staged_runtime_renders_empty_speak_units(server: TritonServer) -> None:
    rt = StagedTritonRuntime(server.grpc_url)
    seen: list[Any] = []
    try:
        await _session(rt, SessionKey("empty", 41), UNITS, seen, config={"seed": 9, "force_listen_count": 0},
                       pcm=lambda i: _pcm(i).tobytes())
    finally:
        await rt.aclose()
    speaking = sorted(e.unit for e in seen if isinstance(e, Decision) and e.action == "speak")
    assert speaking == sorted(EMPTY_UNITS + TURN_ENDS)
    for unit in speaking:
        pieces = [np.frombuffer(e.pcm16, dtype="<i2") for e in seen if isinstance(e, AudioPiece) and e.unit == unit]
        _check_unit_audio(unit, np.concatenate(pieces) if pieces else np.zeros(0, np.int16))
    done = {e.unit: e for e in seen if isinstance(e, UnitDone)}
    assert [u for u in range(UNITS) if done[u].end_of_turn] == list(TURN_ENDS)


def test_the_duplex_pipeline_renders_empty_speak_units(server: TritonServer) -> None:
    session = TritonSession(server.grpc_url, model="duplex")
    try:
        session.request("open", (1, 1, 0), config={"voice": "default", "seed": 9, "force_listen_count": 0})
        replies = [session.request("append", (1, 1, i + 1), pcm=_pcm(i), timeout_s=TIMEOUT_S) for i in range(UNITS)]
        session.request("close", (1, 1, 0))
    finally:
        session.close()
    actions = [r.of_type("decision")[0]["action"] for r in replies]
    assert [u for u, a in enumerate(actions) if a == "speak"] == sorted(EMPTY_UNITS + TURN_ENDS)
    for unit in EMPTY_UNITS + TURN_ENDS:
        audio = replies[unit].audio
        _check_unit_audio(unit, np.concatenate(audio) if audio else np.zeros(0, np.int16))
        assert not replies[unit].of_type("error"), replies[unit].of_type("error")
