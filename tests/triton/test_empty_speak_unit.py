"""A speak unit with zero TTS rows through the real bridges in-process (model.md §3.7 Q11).

Stage0 runs the scripted plan of `text_ids_per_unit: 0` (engine/stage0/script.py): each turn's first speak unit
is `<|speak|><|chunk_eos|>` (decided speak, then the first sampled token ended it: no TTS rows), its second
`<|speak|><|turn_eos|><|chunk_eos|>` (one row, the turn's end). The empty unit still goes to the TTS (condition
`audio_bos` alone), opens the TTS turn and is rendered by Token2Wav like any speak unit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.loader import load_checkpoint
from engine.loader.checkpoint import TTS_COMPONENTS
from engine.stage1.config import TTSEngineConfig
from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import Fence, TTSUnitRequest
from model_repository.common import bridges

from .test_bridges import Sink, pcm, send, settings

PLAN = {"listen_units": 0, "speak_units": 2, "text_ids_per_unit": 0, "tail_listen_units": 1}
UNITS = 4  # unit 0: empty speak (turn start), 1: <|turn_eos|> (turn end), 2: listen, 3: empty speak (turn start)
SEED = 6
UNIT_SAMPLES = 24_000  # one unit of audio (model.md §6.6)


@pytest.fixture(scope="module")
def stages(tiny_checkpoint: Path) -> Iterator[dict[str, Any]]:
    options = {"stage0": json.dumps({"scripted_decisions": PLAN})}
    made = {stage: getattr(bridges, stage)(settings(stage, tiny_checkpoint, **(
        {"engine_options": options[stage]} if stage in options else {}))) for stage in ("stage0", "tts", "token2wav")}
    for bridge in made.values():
        bridge.start()
    yield made
    for bridge in made.values():
        bridge.stop()


def _stage0_units(s0: Any, corrid: int, config: dict[str, Any]) -> list[Sink]:
    send(s0, corrid=corrid, op="open", fence=(1, 1, 0), config={"seed": SEED, "force_listen_count": 0, **config})
    sinks = [send(s0, corrid=corrid, op="append", fence=(1, 1, i + 1), pcm=pcm(i)) for i in range(UNITS)]
    send(s0, corrid=corrid, op="close", fence=(1, 1, 0))
    return sinks


def test_a_speak_unit_without_rows_sends_an_audio_bos_only_tts_input(stages: dict[str, Any]) -> None:
    s0 = stages["stage0"]
    sinks = _stage0_units(s0, 31, {})
    assert [s.outs[0].event["action"] for s in sinks] == ["speak", "speak", "listen", "speak"]
    for index in (0, 3):  # empty speak units, each the start of a turn
        assert sinks[index].kinds() == ["decision", "tts_input", "unit_done"], index
        (tts_in,) = sinks[index].of("tts_input")
        assert tts_in.tokens.size == 0 and tts_in.hidden is not None and tts_in.hidden.size == 0
        assert tts_in.event["is_turn_eos"] == [] and tts_in.event["turn_start"] is True
        assert tts_in.event["end_of_turn"] is False and tts_in.event["unit"] == index
        assert sinks[index].of("unit_done")[0].event["is_listen"] is False
    (close,) = sinks[1].of("tts_input")  # the turn goes on: one row, `<|turn_eos|>`, closes it
    assert close.tokens.tolist() == [s0.engine.ids.turn_eos] and close.hidden.size == s0.hidden_dim
    assert close.event["turn_start"] is False and close.event["end_of_turn"] is True
    assert not sinks[2].of("tts_input")  # a listen unit has no Stage1 input


def test_a_text_only_session_sends_no_tts_input_for_an_empty_speak_unit(stages: dict[str, Any]) -> None:
    sinks = _stage0_units(stages["stage0"], 32, {"text_only": True})
    assert sinks[0].outs[0].event["action"] == "speak"
    assert not any(s.of("tts_input") for s in sinks)


def _direct_codes(ckpt: Path) -> tuple[int, ...]:
    """The empty turn-start unit through a TTSEngine driven directly: condition `audio_bos` alone (n = 0)."""
    ck = load_checkpoint(ckpt, device="cpu", dtype=torch.float32, with_vision=False, with_token2wav=False,
                         components=TTS_COMPONENTS)
    engine = TTSEngine(ck.model.tts, TTSEngineConfig(max_sessions=1, max_batch=1, use_cuda_graphs=False))
    engine.open("ref", Fence(1, 1), seed=SEED)
    engine.submit(TTSUnitRequest(session_id="ref", fence=Fence(1, 1), unit_index=0, text_ids=(),
                                 hidden=torch.zeros(0, ck.config.tts.llm_dim), is_turn_eos=(), end_of_turn=False,
                                 turn_start=True))
    (res,) = engine.step()
    return res.codes


def test_an_empty_speak_unit_is_synthesised_and_rendered(stages: dict[str, Any], tiny_checkpoint: Path) -> None:
    """stage0 -> tts -> token2wav as the gateway chains them: the empty unit's codes are the direct TTS run's,
    it opens the TTS turn (the next unit starts at 0 + 1 + codes), and Token2Wav renders real audio for it."""
    s0, tts, t2w = stages["stage0"], stages["tts"], stages["token2wav"]
    sinks = _stage0_units(s0, 33, {})
    for bridge in (tts, t2w):
        send(bridge, corrid=33, op="open", fence=(1, 1, 0), config={"seed": SEED})
    codes, audio = {}, {}
    for index in (0, 1):
        (tts_in,) = sinks[index].of("tts_input")
        turn = {k: tts_in.event[k] for k in ("is_turn_eos", "end_of_turn", "turn_start")}
        out = send(tts, corrid=33, op="append", fence=(1, 1, index + 1), tokens=tts_in.tokens,
                   hidden=tts_in.hidden if tts_in.hidden.size else None, config={"unit": index, **turn})
        (ev,) = out.of("audio_tokens")
        codes[index] = tuple(ev.tokens.tolist())
        if index == 0:
            assert tts.engine.sessions["33"].tts_pos == 0 + 1 + len(codes[0])  # the turn advanced by n + 1 + codes
        wav = send(t2w, corrid=33, op="append", fence=(1, 1, index + 1), tokens=ev.tokens,
                   config={"unit": index, "end_of_turn": tts_in.event["end_of_turn"]})
        audio[index] = np.concatenate([o.audio for o in wav.of("audio")])
    assert tts.engine.sessions["33"].tts_pos == 0  # unit 1 closed the turn
    assert codes[0] == _direct_codes(tiny_checkpoint) and len(codes[0]) == 25
    assert audio[0].size == UNIT_SAMPLES and np.any(audio[0] != 0)  # rendered speech, not 1 s of silence
    assert audio[1].size > 0
    for bridge in (tts, t2w):
        send(bridge, corrid=33, op="close", fence=(1, 1, 0))
