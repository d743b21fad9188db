"""Engine with ragged batches: 8 sessions, 8 voices (different prompt lengths), staggered units of mixed
sizes, turn ends and cancels; each session's PCM == the same session run alone (I6, §6.8).

Units are submitted while earlier ones are still queued, so one step batches rows at different points
of their turns (first calls with the silence prefix, 28- and 15-code calls, short last calls). A session
is cancelled only when idle, so the oracle knows exactly where its turn was reset.
"""

from __future__ import annotations

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
