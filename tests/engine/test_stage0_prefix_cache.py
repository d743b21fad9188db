"""System prefixes kept per (prompt, reference audio) (engine/stage0/parts.py PrefixEncoder), with the real tiny
audio front end: sessions that share a voice encode it once, a different voice or prompt is encoded anew, the kept
prefix is the one a fresh build gives, and a session's output does not depend on whether its prefix came from the
cache."""

from __future__ import annotations

import pytest
import torch

from engine.audio import AudioFrontEnd
from engine.stage0 import DecodeRules, Fence, Stage0Config, Stage0Engine, TokenEvent
from engine.stage0.frontend import AudioFrontEndAdapter
from engine.stage0.parts import PrefixEncoder
from tests.engine.test_audio_encoder import build, tiny_audio
from tests.engine.test_stage0_engine import by_session, params
from tests.engine.test_stage0_helpers import tiny_llm, tiny_tokenizer, unit_pcm


class CountingFrontEnd(AudioFrontEndAdapter):
    """The real tiny audio front end, counting the reference encodes."""

    def __init__(self) -> None:
        enc, proj = build(1500, seed=3)
        super().__init__(AudioFrontEnd(enc, proj, tiny_audio(1500), kv_slots=4))
        self.references = 0

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        self.references += 1
        return super().encode_reference(pcm)


def _voice(seed: int) -> torch.Tensor:
    return torch.randn(8000, generator=torch.Generator().manual_seed(seed))


def _engine(sessions: int = 4) -> tuple[Stage0Engine, list, CountingFrontEnd]:
    events: list = []
    frontend = CountingFrontEnd()
    engine = Stage0Engine(tiny_llm(), tiny_tokenizer(), frontend, events.append,
                          Stage0Config(max_sessions=sessions, use_cuda_graphs=False), DecodeRules(force_listen_count=1))
    return engine, events, frontend


def test_sessions_sharing_a_voice_encode_it_once() -> None:
    engine, _, frontend = _engine()
    for i in range(3):  # equal samples in distinct tensors
        engine.open(f"s{i}", Fence(1, 0), ref_audio=_voice(1).clone())
    assert frontend.references == 1
    engine.open("other-voice", Fence(1, 0), ref_audio=_voice(2))
    assert frontend.references == 2
    rows = [engine.session(f"s{i}").prefix_rows for i in range(3)]
    fresh = engine.prefix._build(engine.config.default_prompt, _voice(1))
    for r in rows:
        torch.testing.assert_close(r, fresh, rtol=0, atol=0)
    assert not torch.equal(engine.session("other-voice").prefix_rows, fresh)


def test_a_different_prompt_is_built_anew_and_the_oldest_prefix_leaves() -> None:
    engine, _, frontend = _engine()
    prefix = engine.prefix
    voice = _voice(3)
    for k in range(PrefixEncoder.CACHED):
        prefix.embeds(f"prompt {k}", voice)
    assert frontend.references == PrefixEncoder.CACHED
    prefix.embeds("prompt 1", voice)  # kept: no encode, and now the most recent
    assert frontend.references == PrefixEncoder.CACHED
    prefix.embeds("one more", voice)  # the cache is full: "prompt 0", the least recent, leaves
    prefix.embeds("prompt 1", voice)
    assert frontend.references == PrefixEncoder.CACHED + 1
    prefix.embeds("prompt 0", voice)
    assert frontend.references == PrefixEncoder.CACHED + 2
    prefix.embeds("prompt 0", None)  # no voice is another prefix
    assert frontend.references == PrefixEncoder.CACHED + 2


def test_output_is_the_same_with_a_shared_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sessions fed one shared prefix tensor, then each its own (nothing kept): the same events."""
    runs = []
    for keep in (PrefixEncoder.CACHED, 0):
        monkeypatch.setattr(PrefixEncoder, "CACHED", keep)
        events: list = []
        engine = Stage0Engine(tiny_llm(), tiny_tokenizer(), CountingFrontEnd(), events.append,
                              Stage0Config(max_sessions=2, use_cuda_graphs=False), DecodeRules(force_listen_count=1))
        for i in range(2):
            engine.open(f"s{i}", Fence(1, 0), ref_audio=_voice(4), params=params(i))
        shared = engine.session("s0").prefix_rows is engine.session("s1").prefix_rows
        assert shared == (keep > 0)
        for k in range(3):
            for i in range(2):
                engine.append(f"s{i}", Fence(1, 0, seq=k), unit_pcm(i, k))
            engine.run_until_idle()
        runs.append(events)
    for sid in ("s0", "s1"):
        got, want = by_session(runs[0], sid), by_session(runs[1], sid)
        assert [(type(e), e.unit_index, getattr(e, "token_id", None)) for e in got] == \
            [(type(e), e.unit_index, getattr(e, "token_id", None)) for e in want]
        assert any(isinstance(e, TokenEvent) for e in got)
