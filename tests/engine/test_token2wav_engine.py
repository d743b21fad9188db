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


def make_engine(models, ragged: bool = True, **stream_kw) -> Token2WavEngine:
    eng = Token2WavEngine(models, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS, **stream_kw),
                                                        ragged=ragged))
    eng.add_voice("a", make_voice(1))
    eng.add_voice("b", make_voice(2, 12))
    return eng


def view_ranges(tensors) -> list[tuple[int, int]]:
    """Byte ranges of contiguous views (pool slots share one storage but never overlap)."""
    assert all(t.is_contiguous() for t in tensors)
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]


def disjoint(a, b) -> bool:
    return not any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


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


@pytest.mark.parametrize("ragged", [True, False])
def test_batched_equals_per_session(models, ragged):
    eng = make_engine(models, ragged)
    for sid, (voice, seed, _) in SCRIPT.items():
        eng.open(sid, F0, voice, seed)
    for u in range(4):
        for sid, (_, _, units) in SCRIPT.items():
            n, eot = units[u]
            eng.submit(sid, F0, u, codes(100 * u + len(sid) + int(sid[1]), n), eot)
    chunks = []
    while eng.pending():
        chunks += eng.step()
        ranges = [view_ranges(s.stream.owned_tensors()) for s in eng.sessions.values()]
        voice = view_ranges([t for v in eng.voices.values() for t in v.tensors()])
        assert all(disjoint(r, q) for i, r in enumerate(ranges) for q in ranges[i + 1:] + [voice])   # §6.8
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
    for u in range(3):   # pooled vs solo: equal within 1e-5, so at most one int16 step apart
        want = alone.synthesize_unit(codes(10 + u, 25), False) * 32768
        assert np.abs(y_units[u].astype(np.float64) - want).max() <= 1
    x_units = per_unit(first + rest, "x")
    assert sorted(x_units) == [0, 3]
    fresh = new_session(models, eng.voices["a"], eng.cfg.stream, 1)
    fresh.synthesize_unit(codes(0, 25), False)    # same generator draws as unit 0 of x
    fresh.reset_turn()                            # the cancel reset x's turn
    assert np.abs(x_units[3].astype(np.float64) - fresh.synthesize_unit(codes(3, 25), False) * 32768).max() <= 1


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
@pytest.mark.parametrize("mode", ["exact", "ragged", "ragged_graphs"])
def test_cuda_graph_equals_eager(models, mode):
    """exact: DiT, encoder and HiFT graphs. ragged: HiFT graphs, eager flow. ragged_graphs: + ragged encoder
    and solve graphs."""
    dev = torch.device("cuda")
    gpu = Token2WavModels(models.flow.to(dev), models.hift.to(dev), TINY_FLOW, TINY_HIFT, "A")
    runs = []
    ragged = mode != "exact"
    for graphs in (False, True):
        eng = Token2WavEngine(gpu, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), use_cuda_graphs=graphs,
                                                         ragged=ragged, ragged_graphs=mode == "ragged_graphs"))
        eng.add_voice("a", make_voice(1))
        eng.add_voice("b", make_voice(2, 12))
        for sid in ("p", "q", "r"):
            eng.open(sid, F0, "b" if sid == "r" else "a", 7)
            for u in range(4):
                eng.submit(sid, F0, u, codes(u + len(sid), 12 if sid == "r" else 25), u == 3)
        runs.append(drain(eng))
        assert bool(eng.graphs.dit_graphs) == (graphs and not ragged) and bool(eng.graphs.hift_graphs) == graphs
        assert bool(eng.graphs.enc_graphs) == (graphs and not ragged)
        assert bool(eng.solver.graphs) == (graphs and mode == "ragged_graphs")
        assert bool(eng.solver.enc_graphs) == (graphs and mode == "ragged_graphs")
    models.flow.cpu()
    models.hift.cpu()
    for sid in ("p", "q", "r"):
        eager, graph = per_unit(runs[0], sid), per_unit(runs[1], sid)
        for u in eager:
            assert eager[u].shape == graph[u].shape
            assert np.abs(eager[u].astype(np.int32) - graph[u]).max() <= 2
