"""Engine with ragged batches: 8 sessions, 8 voices (different prompt lengths), staggered units of mixed
sizes, turn ends and cancels; each session's PCM == the same session run alone (I6, §6.8).

Units are submitted while earlier ones are still queued, so one step batches rows at different points
of their turns (first calls with the silence prefix, 28- and 15-code calls, short last calls). A session
is cancelled only when idle, so the oracle knows exactly where its turn was reset.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from engine.stage1.token2wav_engine import CapacityError, Token2WavEngine, Token2WavEngineConfig
from engine.stage1.types import Fence
from engine.token2wav.assets import TINY_HIFT, Token2WavModels, build_tiny_modules
from engine.token2wav.config import TINY_FLOW, StreamConfig
from engine.token2wav.pool import PoolConfig
from engine.token2wav.stream import new_session
from tests.engine.test_token2wav_engine import disjoint, per_unit, view_ranges
from tests.engine.test_token2wav_refutil import enlarge_flow_
from tests.engine.test_token2wav_stream import codes, make_voice

N_TS = 2
PROMPT_TOKENS = [5, 8, 12, 20, 30, 45, 55, 60]
UNIT_SIZES = [25, 25, 12, 4, 30, 3]
LSB = 1                      # int16 truncation of values equal within 1e-5 may still differ by one step


@pytest.fixture(scope="module")
def models() -> Token2WavModels:
    flow, hift = build_tiny_modules(seed=0)
    enlarge_flow_(flow)
    with torch.no_grad():
        hift.conv_post.bias.fill_(1.0)
    return Token2WavModels(flow.eval(), hift.eval(), TINY_FLOW, TINY_HIFT, "A")


def test_ragged_engine_equals_solo(models):
    cfg = Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), pool=PoolConfig(slots=8, max_prompt_frames=128))
    eng = Token2WavEngine(models, cfg)
    sids = [f"s{i}" for i in range(len(PROMPT_TOKENS))]
    fences = {sid: Fence(1, 0) for sid in sids}
    scripts: dict[str, list] = {sid: [] for sid in sids}        # ("unit", index, seed, n, eot) | ("cancel",)
    for i, (sid, p) in enumerate(zip(sids, PROMPT_TOKENS, strict=True)):
        eng.add_voice(f"v{i}", make_voice(20 + i, p))
        eng.open(sid, fences[sid], f"v{i}", seed=i)
    with pytest.raises(CapacityError):                          # every slot is taken
        eng.open("extra", Fence(1, 0), "v0", seed=0)
    rng = random.Random(7)
    chunks, batch_rows, unit_of = [], set(), dict.fromkeys(sids, 0)
    for _ in range(12):
        for sid in sids:
            if rng.random() < 0.6:
                n, eot = rng.choice(UNIT_SIZES), rng.random() < 0.25
                seed = 1000 * int(sid[1:]) + unit_of[sid]
                eng.submit(sid, fences[sid], unit_of[sid], codes(seed, n), eot)
                scripts[sid].append(("unit", unit_of[sid], seed, n, eot))
                unit_of[sid] += 1
            elif not eng.sessions[sid].queue and rng.random() < 0.3:
                nxt = Fence(1, fences[sid].epoch + 1)
                assert eng.cancel(sid, fences[sid], nxt).dropped_units == ()
                fences[sid] = nxt
                scripts[sid].append(("cancel",))
        for _ in range(rng.randint(1, 2)):
            batch_rows.add(sum(1 for s in eng.sessions.values() if s.queue and s.queue[0].call is not None))
            chunks += eng.step()
            ranges = [view_ranges(s.stream.owned_tensors()) for s in eng.sessions.values()]
            assert all(disjoint(r, q) for i, r in enumerate(ranges) for q in ranges[i + 1:])   # §6.8
    while eng.pending():
        chunks += eng.step()
    assert max(batch_rows) >= 6
    for i, sid in enumerate(sids):
        alone = new_session(models, eng.voices[f"v{i}"], eng.cfg.stream, seed=i)
        got = per_unit(chunks, sid)
        for entry in scripts[sid]:
            if entry[0] == "cancel":
                alone.reset_turn()
                continue
            _, u, seed, n, eot = entry
            want = (alone.synthesize_unit(codes(seed, n), eot) * 32768).astype(np.int32)
            assert got[u].shape == want.shape, (sid, u)
            assert np.abs(got[u].astype(np.int32) - want).max() <= LSB, (sid, u)
    assert any(e[0] == "cancel" for s in scripts.values() for e in s)
    assert any(e[0] == "unit" and e[4] for s in scripts.values() for e in s)
    assert eng.close("s0", fences["s0"])
    eng.open("again", Fence(1, 0), "v3", seed=0)                 # the freed slot is reused


def watched_turn(models: Token2WavModels, cfg: Token2WavEngineConfig, others: int, last: bool = False
                 ) -> tuple[list[torch.Tensor], bytes]:
    """A watched session's turn (25, 25, 12 codes) beside `others` sessions with longer prompts (wider histories)
    a unit ahead in their turns (so its rows meet other calls), the watched session first or `last` in the
    batch: its mel per flow call and its PCM."""
    eng = Token2WavEngine(models, cfg)
    mels, pcm, run_flow = [], [], eng._run_flow

    def flow(work: list) -> None:
        run_flow(work)
        mels.extend(item.call.mel.clone() for sid, _, item in work if sid == "w" and item.call is not None)
    eng._run_flow = flow  # type: ignore[method-assign]
    for i, p in enumerate([8] + PROMPT_TOKENS[3:3 + others]):
        eng.add_voice(f"v{i}", make_voice(40 + i, p))
    sids = [f"o{i}" for i in range(1, others + 1)]
    order = sids + ["w"] if last else ["w"] + sids
    for sid in order:
        eng.open(sid, Fence(1, 0), "v0" if sid == "w" else f"v{sid[1:]}", seed=len(sid) + 3)
    for sid in sids:
        eng.submit(sid, Fence(1, 0), 0, codes(500 + int(sid[1:]), 12), False)
    for u, n in enumerate((25, 25, 12)):
        for sid in order:
            eng.submit(sid, Fence(1, 0), u + (sid != "w"), codes(600 + 10 * u + len(sid), n), sid == "w" and u == 2)
    while eng.pending():
        pcm += [c.pcm.tobytes() for c in eng.step() if c.session_id == "w"]
    return mels, b"".join(pcm)


@pytest.mark.parametrize("last", [False, True])
def test_flow_rows_do_not_mix_in_float64(models, last):
    """The pooled flow holds no cross-row term: in float64 a session's mel per call is the same alone and in a
    ragged batch (others with longer prompts, so wider histories, and at other points of their turns), first or
    last in the batch, to 1e-12. The PCM tests above allow an LSB of rounding; this bound would catch a padded
    or masked position that leaks into a row (on the GPU the float16 mel differs by one step, bench/RESULTS.md
    stop 39: kernel rounding, not a leak)."""
    flow64 = Token2WavModels(copy.deepcopy(models.flow).double(), models.hift, TINY_FLOW, TINY_HIFT, "A")
    cfg = Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), pool=PoolConfig(slots=5, max_prompt_frames=128))
    alone, _ = watched_turn(flow64, cfg, 0, last)
    assert len(alone) >= 3 and alone[0].dtype == torch.float64
    for others in (1, 4):
        got, _ = watched_turn(flow64, cfg, others, last)
        assert [m.shape for m in got] == [m.shape for m in alone]
        assert max(float((a - b).abs().max()) for a, b in zip(alone, got, strict=True)) <= 1e-12


@pytest.mark.parametrize("tile", [4, pytest.param(0, marks=pytest.mark.xfail(
    strict=True, reason="untiled, a convolution's kernel follows the batch's rows (oneDNN on a CPU, cuDNN on a GPU)"))])
def test_tile_rows_keep_a_sessions_mel_and_pcm_bits_whatever_shares_its_batch(models, tile):
    """`tile_rows`: every flow and HiFT batch on exactly that many rows at the widest token width, so a session's
    mel and PCM are the same bits alone and among others at other points of their turns, with other prompts,
    first or last in the batch, and past one tile (5 sessions in tiles of 4). Without the tiles, in float32 on a
    CPU, the mel differs in its last bits (the pre-lookahead convolution at 1 row against 2)."""
    cfg = Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), max_batch=5, tile_rows=tile,
                                pool=PoolConfig(slots=5, max_prompt_frames=128))
    alone_mels, alone_pcm = watched_turn(models, cfg, 0)
    assert len(alone_mels) >= 3 and len(alone_pcm) > 0
    for others, last in ((1, False), (4, False), (4, True)):
        mels, pcm = watched_turn(models, cfg, others, last)
        assert [m.shape for m in mels] == [m.shape for m in alone_mels]
        assert all(torch.equal(a, b) for a, b in zip(alone_mels, mels, strict=True)), (others, last)
        assert pcm == alone_pcm, (others, last)


@pytest.mark.parametrize("tile", [-1, 6])
def test_tile_rows_outside_the_batch_are_refused(tile):
    with pytest.raises(ValueError, match="tile_rows"):
        Token2WavEngineConfig(max_batch=5, tile_rows=tile)


def test_tile_rows_need_the_pooled_flow():
    with pytest.raises(ValueError, match="pooled flow"):
        Token2WavEngineConfig(max_batch=5, tile_rows=2, ragged=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_tile_rows_on_cuda_in_float16_graphs_keep_a_sessions_bits(models):
    """The same with the float16 flow and the CUDA graphs of the ragged encoder, solve and HiFT, as served: the
    graphs of the tile only (full size on an H100: bench/RESULTS.md stop 46)."""
    dev = torch.device("cuda")
    gpu = Token2WavModels(copy.deepcopy(models.flow).to(dev, torch.float16), copy.deepcopy(models.hift).to(dev),
                          TINY_FLOW, TINY_HIFT, "A")
    cfg = Token2WavEngineConfig(stream=StreamConfig(n_timesteps=N_TS), max_batch=5, tile_rows=4,
                                pool=PoolConfig(slots=5, max_prompt_frames=128))
    alone_mels, alone_pcm = watched_turn(gpu, cfg, 0)
    for others, last in ((1, False), (4, True)):
        mels, pcm = watched_turn(gpu, cfg, others, last)
        assert all(torch.equal(a, b) for a, b in zip(alone_mels, mels, strict=True)), (others, last)
        assert pcm == alone_pcm, (others, last)
