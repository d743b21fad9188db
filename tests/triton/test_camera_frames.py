"""Camera frames reach the thinker's prompt (issue 17): in-process through the stage0 bridge, and end to end
through the real tritonserver's `duplex` pipeline on the tiny checkpoint (its SigLIP + resampler are tiny).

A frame block is `<image>` + 64 embeddings + `</image>` = 66 positions in the unit (model.md §3.3); a forced
listen unit is then exactly `<unit>` + 66 + 10 audio + `<|listen|>` + `</unit>`.
"""

from __future__ import annotations

import threading
from itertools import count
from typing import Any

import pytest

from model_repository.common import bridges
from serve.launcher import TritonServer
from tests.engine.test_frames import image_bytes
from tests.triton.test_bridges import pcm, send, settings

from .talk import StageSession, session_config

FRAME_POSITIONS = 66
LISTEN_UNIT = 13  # <unit> + 10 audio + <|listen|> + </unit>
UNITS = 4
_corrids = count(300)


@pytest.fixture(scope="module")
def stage0(tiny_checkpoint: Any) -> Any:
    bridge = bridges.stage0(settings("stage0", tiny_checkpoint))
    bridge.start()
    yield bridge
    bridge.stop()


def camera_run(stage0: Any, frame: bytes | None) -> tuple[list[int], list[Any]]:
    """Unit 0 forced to listen (with `frame` if any), then free units: the ledger spans and the free units' output."""
    corrid = next(_corrids)
    send(stage0, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 5, "temperature": 1.5,
                                                                      "force_listen_count": 0})
    frames = () if frame is None else (frame,)
    send(stage0, corrid=corrid, op="append", fence=(1, 1, 1), pcm=pcm(0, 4), frames=frames, force_listen=True)
    out = []
    for k in range(1, UNITS):
        sink = send(stage0, corrid=corrid, op="append", fence=(1, 1, k + 1), pcm=pcm(k, 4))
        out.append((sink.of("decision")[0].event["action"], [(o.event["token_id"]) for o in sink.of("text")]))
    spans = [r.span for r in stage0.engine.session(str(corrid)).ledger]
    send(stage0, corrid=corrid, op="close", fence=(1, 1, 0))
    return spans, out


def test_a_frame_enters_the_units_prompt_and_changes_what_follows(stage0: Any) -> None:
    plain_spans, plain = camera_run(stage0, None)
    cam_spans, cam = camera_run(stage0, image_bytes(640, 480))
    assert plain_spans[0] == LISTEN_UNIT and cam_spans[0] == LISTEN_UNIT + FRAME_POSITIONS
    assert cam != plain  # same seed, same audio: only the frame in the context differs


def test_a_bad_frame_fails_its_append_alone(stage0: Any) -> None:
    corrid = next(_corrids)
    send(stage0, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": 1})
    bad = send(stage0, corrid=corrid, op="append", fence=(1, 1, 1), pcm=pcm(0), frames=(b"not a jpeg",))
    assert [o.event.get("code") for o in bad.outs] == ["invalid_request"]
    ok = send(stage0, corrid=corrid, op="append", fence=(1, 1, 1), pcm=pcm(0), frames=(image_bytes(448, 448, "PNG"),))
    assert ok.kinds()[-1] == "unit_done" and not ok.of("error")  # the same seq again: nothing was taken
    send(stage0, corrid=corrid, op="close", fence=(1, 1, 0))


@pytest.mark.e2e
def test_camera_frames_through_tritonserver(torch_server: TritonServer) -> None:
    """Two sessions send frames at once (the step batches them), a third none; a bad frame is typed."""
    runs: dict[str, list[dict[str, Any]]] = {}

    def talk(name: str, frame: bytes | None) -> None:
        s = StageSession(torch_server.grpc_url, model="duplex")
        try:
            s.request("open", (1, 1, 0), config=session_config(5, temperature=1.5))
            frames = {} if frame is None else {"frames": (frame,)}
            events = [e for k in range(UNITS) for e in s.request(
                "append", (1, 1, k + 1), pcm=pcm(k, 4), force_listen=k == 0, timeout_s=120.0, **frames).events]
            runs[name] = events
            if name == "jpeg":
                bad = s.request("append", (1, 1, UNITS + 1), pcm=pcm(UNITS, 4), frames=(b"\x89PNG broken",))
                runs["bad"] = bad.events
            s.request("close", (1, 1, 0))
        finally:
            s.close()

    threads = [threading.Thread(target=talk, args=a) for a in
               (("jpeg", image_bytes(640, 480)), ("png", image_bytes(448, 448, "PNG", seed=1)), ("none", None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(runs) == {"jpeg", "png", "none", "bad"}
    for name in ("jpeg", "png", "none"):
        assert not [e for e in runs[name] if e["type"] == "error"], runs[name]
        assert [e["unit"] for e in runs[name] if e["type"] == "unit_done"] == list(range(UNITS))
    tokens = {name: [(e["type"], e.get("action"), e.get("token_id")) for e in runs[name]
                     if e["type"] in ("decision", "text")] for name in ("jpeg", "png", "none")}
    assert tokens["jpeg"] != tokens["none"] and tokens["png"] != tokens["none"]  # the frames reached the LLM
    assert [e.get("code") for e in runs["bad"]] == ["invalid_request"]
