"""Token2Wav engine: batched == per-session (I6), cancel with a fence, typed errors, first-hop option."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.stage1.token2wav_engine import (
    CodeRangeError,
    StaleFenceError,
    Token2WavEngine,
    Token2WavEngineConfig,
    UnknownSessionError,
    UnknownVoiceError,
)
from engine.stage1.types import Fence
from engine.token2wav.assets import TINY_HIFT, Token2WavModels, build_tiny_modules
from engine.token2wav.config import TINY_FLOW, StreamConfig
from engine.token2wav.stream import new_session
from tests.engine.test_token2wav_refutil import enlarge_flow_
from tests.engine.test_token2wav_stream import codes, make_voice

N_TS = 2
F0 = Fence(1, 0)


@pytest.fixture(scope="module")
def models() -> Token2WavModels:
    flow, hift = build_tiny_modules(seed=0)
    enlarge_flow_(flow)
    with torch.no_grad():
        hift.conv_post.bias.fill_(1.0)
    return Token2WavModels(flow.eval(), hift.eval(), TINY_FLOW, TINY_HIFT, "A")


def make_engine(models, **stream_kw) -> Token2WavEngine:
    eng = Token2WavEngine(models, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS, **stream_kw)))
    eng.add_voice("a", make_voice(1))
    eng.add_voice("b", make_voice(2, 12))
    return eng


def drain(eng: Token2WavEngine) -> list:
    out = []
    while eng.pending():
        out += eng.step()
    return out


def per_unit(chunks, sid):
    units: dict[int, list[np.ndarray]] = {}
    for c in chunks:
        if c.session_id == sid:
            units.setdefault(c.unit_index, []).append(c.pcm)
    return {k: np.concatenate(v) for k, v in units.items()}


SCRIPT = {  # session → (voice, seed, units as (n_codes, end_of_turn))
    "s1": ("a", 1, [(25, False), (25, False), (12, True), (25, False)]),
    "s2": ("a", 2, [(25, False), (25, False), (25, False), (25, False)]),
    "s3": ("b", 3, [(10, False), (25, False), (3, True), (25, False)]),
}


def test_batched_equals_per_session(models):
    eng = make_engine(models)
    for sid, (voice, seed, _) in SCRIPT.items():
        eng.open(sid, F0, voice, seed)
    for u in range(4):
        for sid, (_, _, units) in SCRIPT.items():
            n, eot = units[u]
            eng.submit(sid, F0, u, codes(100 * u + len(sid) + int(sid[1]), n), eot)
    chunks = []
    while eng.pending():
        chunks += eng.step()
        ptrs = [{t.untyped_storage().data_ptr() for t in s.stream.owned_tensors() if t.numel()}
                for s in eng.sessions.values()]
        voice_ptrs = {t.untyped_storage().data_ptr() for v in eng.voices.values() for t in v.tensors()}
        assert all(not (p & q) for i, p in enumerate(ptrs) for q in ptrs[i + 1:] + [voice_ptrs])   # §6.8
    for sid, (voice, seed, units) in SCRIPT.items():
        alone = new_session(models, eng.voices[voice], eng.cfg.stream, seed)
        got = per_unit(chunks, sid)
        for u, (n, eot) in enumerate(units):
            want = alone.synthesize_unit(codes(100 * u + len(sid) + int(sid[1]), n), eot)
            pcm = got[u].astype(np.float32) / 32768
            assert pcm.shape == want.shape, (sid, u)
            assert np.abs(pcm - want).max() <= 1.5 / 32768
    finals = [c for c in chunks if c.unit_final]
    assert len(finals) == 12


def test_cancel_drops_only_that_session(models):
    eng = make_engine(models)
    eng.open("x", F0, "a", 1)
    eng.open("y", F0, "b", 2)
    for u in range(3):
        eng.submit("x", F0, u, codes(u, 25), False)
        eng.submit("y", F0, u, codes(10 + u, 25), False)
    first = eng.step()
    res = eng.cancel("x", F0, Fence(1, 1))
    assert res.dropped_units == (1, 2) and not res.noop
    assert eng.cancel("x", F0, Fence(1, 1)).noop                  # late cancel: no-op
    with pytest.raises(StaleFenceError):
        eng.submit("x", F0, 5, codes(1, 25), False)
    eng.submit("x", Fence(1, 1), 3, codes(3, 25), False)
    rest = drain(eng)
    y_units = per_unit(first + rest, "y")
    alone = new_session(models, eng.voices["b"], eng.cfg.stream, 2)
    for u in range(3):
        np.testing.assert_array_equal(y_units[u].astype(np.float32) / 32768, alone.synthesize_unit(codes(10 + u, 25), False))
    x_units = per_unit(first + rest, "x")
    assert sorted(x_units) == [0, 3]
    fresh = new_session(models, eng.voices["a"], eng.cfg.stream, 1)
    fresh.synthesize_unit(codes(0, 25), False)    # same generator draws as unit 0 of x
    fresh.reset_turn()                            # the cancel reset x's turn
    np.testing.assert_array_equal(x_units[3].astype(np.float32) / 32768, fresh.synthesize_unit(codes(3, 25), False))


def test_typed_errors_change_nothing(models):
    eng = make_engine(models)
    with pytest.raises(UnknownSessionError):
        eng.submit("nope", F0, 0, [1], False)
    with pytest.raises(UnknownVoiceError):
        eng.open("z", F0, "missing", 0)
    eng.open("z", F0, "a", 0)
    with pytest.raises(CodeRangeError):
        eng.submit("z", F0, 0, [1, TINY_FLOW.vocab_size], False)
    with pytest.raises(CodeRangeError):
        eng.submit("z", F0, 0, [-1], False)
    assert eng.pending() == 0 and eng.sessions["z"].stream.buffer == [eng.cfg.stream.silence_code] * 3
    with pytest.raises(StaleFenceError):
        eng.submit("z", Fence(2, 0), 0, [1], False)
    with pytest.raises(StaleFenceError):
        eng.cancel("z", F0, Fence(1, 2))


def test_listen_and_short_units(models):
    eng = make_engine(models)
    eng.open("s", F0, "a", 0)
    eng.submit_listen("s", F0, 0)
    assert eng.submit("s", F0, 1, codes(1, 4), False) == 24000       # < 8 buffered: silence
    assert eng.submit("s", F0, 2, codes(2, 6), False) == 24000       # one short call, left-padded
    chunks = drain(eng)
    units = per_unit(chunks, "s")
    assert all(units[u].shape == (24000,) for u in range(3))
    assert not units[0].any() and not units[1].any() and not units[2][:24000 - 20 * 480].any()


def test_first_hop_option(models):
    base, hop = make_engine(models), make_engine(models, first_hop=5)
    for eng in (base, hop):
        eng.open("s", F0, "a", 0)
        eng.submit("s", F0, 0, codes(1, 25), False)
        eng.submit("s", F0, 1, codes(2, 25), False)
    b, h = drain(base), drain(hop)
    assert b[0].pcm.shape[0] == 24000 and h[0].pcm.shape[0] == 10 * 480    # earlier, smaller first chunk
    assert [u.shape for u in per_unit(h, "s").values()] == [(24000,), (24000,)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_equals_eager(models):
    dev = torch.device("cuda")
    gpu = Token2WavModels(models.flow.to(dev), models.hift.to(dev), TINY_FLOW, TINY_HIFT, "A")
    runs = []
    for graphs in (False, True):
        eng = Token2WavEngine(gpu, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS),
                                                         use_cuda_graphs=graphs))
        eng.add_voice("a", make_voice(1))
        for sid in ("p", "q"):
            eng.open(sid, F0, "a", 7)
            for u in range(4):
                eng.submit(sid, F0, u, codes(u + len(sid), 25), u == 3)
        runs.append(drain(eng))
        assert bool(eng.graphs.dit_graphs) == graphs and bool(eng.graphs.hift_graphs) == graphs
        assert bool(eng.graphs.enc_graphs) == graphs
    models.flow.cpu()
    models.hift.cpu()
    for sid in ("p", "q"):
        eager, graph = per_unit(runs[0], sid), per_unit(runs[1], sid)
        for u in eager:
            assert eager[u].shape == graph[u].shape
            assert np.abs(eager[u].astype(np.int32) - graph[u]).max() <= 2
