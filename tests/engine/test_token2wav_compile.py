"""Token2Wav `compile_flow` / `compile_hift`: the flow's conformer and DiT blocks, and the HiFT's Snake activations,
run through one torch.compile'd function of each kind and the engine's PCM stays that of the eager blocks (tiny checkpoint; on the GPU with the
CUDA graphs as well)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine.model.layers import run_layer
from engine.stage1.token2wav_engine import Token2WavEngine, Token2WavEngineConfig
from engine.stage1.types import Fence
from engine.token2wav.assets import Token2WavModels
from engine.token2wav.config import StreamConfig
from engine.token2wav.hift import HiFT, Snake, snake
from engine.token2wav.pool import PoolConfig
from tests.engine.test_token2wav_engine import per_unit
from tests.engine.test_token2wav_engine_ragged import PROMPT_TOKENS
from tests.engine.test_token2wav_engine_ragged import models as ragged_models
from tests.engine.test_token2wav_stream import codes, make_voice

F0 = Fence(1, 0)
SESSIONS = 3


def snake_fn(hift: HiFT) -> object:
    """What the HiFT's Snake activations run (all share one)."""
    fns = {id(m.fn): m.fn for m in hift.modules() if isinstance(m, Snake)}
    assert len(fns) == 1
    return next(iter(fns.values()))


@pytest.fixture(scope="module")
def models() -> Token2WavModels:
    return ragged_models.__wrapped__()


def _pcm(models: Token2WavModels, device: str, **cfg: object) -> dict[str, dict[int, np.ndarray]]:
    """Three sessions with their own voices, a turn of three units each (a short one in the middle session)."""
    m = copy.deepcopy(models)
    if device != "cpu":
        m = Token2WavModels(m.flow.to(device), m.hift.to(device), m.flow_cfg, m.hift_cfg, m.layout)
    eng = Token2WavEngine(m, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=2),
                                                   pool=PoolConfig(slots=4, max_prompt_frames=128), **cfg))
    assert (eng.models.flow.decoder.estimator.block_fn is run_layer) != bool(cfg.get("compile_flow"))
    assert (eng.models.flow.encoder.block_fn is run_layer) != bool(cfg.get("compile_flow"))
    assert (snake_fn(eng.models.hift) is snake) != bool(cfg.get("compile_hift"))
    for i in range(SESSIONS):
        eng.add_voice(f"v{i}", make_voice(20 + i, PROMPT_TOKENS[i]))
        eng.open(f"s{i}", F0, f"v{i}", seed=i)
    out = []
    for unit in range(3):
        for i in range(SESSIONS):
            eng.submit(f"s{i}", F0, unit, codes(100 * i + unit, 12 if i == 1 else 25), unit == 2)
        while eng.pending():
            out += eng.step()
    return {f"s{i}": per_unit(out, f"s{i}") for i in range(SESSIONS)}


def _max_lsb(a: dict[str, dict[int, np.ndarray]], b: dict[str, dict[int, np.ndarray]]) -> int:
    assert {s: sorted(u) for s, u in a.items()} == {s: sorted(u) for s, u in b.items()}
    return max(int(np.abs(a[s][u].astype(np.int32) - b[s][u].astype(np.int32)).max()) for s in a for u in a[s])


@pytest.mark.parametrize("part", ["compile_flow", "compile_hift"])
def test_compiled_blocks_give_the_eager_pcm(models: Token2WavModels, part: str) -> None:
    import torch._dynamo.utils

    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _pcm(models, "cpu", use_cuda_graphs=False, **{part: True})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the blocks did go through dynamo
    assert _max_lsb(compiled, _pcm(models, "cpu", use_cuda_graphs=False)) <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_blocks_in_the_graphs(models: Token2WavModels) -> None:
    """Compiled before capture, replayed from the ragged solve and vocoder graphs: within 2 LSB of the eager
    engine, as the uncompiled graphs are (test_token2wav_engine's graph == eager)."""
    eager = _pcm(models, "cuda", use_cuda_graphs=False)
    assert _max_lsb(_pcm(models, "cuda", compile_flow=True, compile_hift=True), eager) <= 2
    assert _max_lsb(_pcm(models, "cuda"), eager) <= 2  # the uncompiled graphs, for scale


def test_warm_up_compiles_without_graphs(models: Token2WavModels) -> None:
    """Without CUDA graphs (a CPU) warm-up still runs turns when blocks are compiled, so that dynamo compiles
    there and not on the first sessions' audio (served on the CPU, that first audio came 11 s late); a turn like
    the warm-up's then compiles nothing new."""
    import torch._dynamo.utils

    stats = torch._dynamo.utils.counters["stats"]
    m = copy.deepcopy(models)
    eng = Token2WavEngine(m, Token2WavEngineConfig(stream=StreamConfig(n_timesteps=2), use_cuda_graphs=False,
                                                   pool=PoolConfig(slots=4, max_prompt_frames=128), max_batch=2,
                                                   compile_flow=True, compile_hift=True))
    eng.add_voice("v", make_voice(20, PROMPT_TOKENS[0]))
    before = stats["unique_graphs"]
    eng.warm_up("v")
    warmed = stats["unique_graphs"]
    assert warmed > before
    eng.open("s", F0, "v", seed=0)
    out = []
    for unit in range(3):
        eng.submit("s", F0, unit, codes(unit, eng.cfg.stream.chunk_new), unit == 2)
        while eng.pending():
            out += eng.step()
    assert len(per_unit(out, "s")) == 3
    assert stats["unique_graphs"] == warmed
