"""I10 for the TTS code step: CUDA graph = eager (identical codes on tiny fp32). GPU only."""

from __future__ import annotations

import pytest
import torch

from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import TTSUnitResult
from tests.engine.test_tts_engine import F0, _cfg, _unit
from tests.engine.test_tts_helpers import tiny_model, with_eos_bias

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _session_run(use_graphs: bool, max_batch: int, compile_step: bool = False,
                 continuous: bool = False) -> list[TTSUnitResult]:
    model = with_eos_bias(tiny_model().cuda(), 6.0)
    engine = TTSEngine(model, _cfg(max_batch=max_batch, max_turn_positions=1024, compile_step=compile_step,
                                   continuous=continuous))
    if continuous and use_graphs:  # the lanes' step graphs are built at warm-up only
        engine.runner.warm_up()
    out: list[TTSUnitResult] = []
    for s in range(6):
        engine.open(f"s{s}", F0, seed=10 + s)
    for unit in range(10):  # 10 units per session, a turn closes every 4th unit
        for s in range(6):
            if (unit + s) % 5 != 4:  # sessions skip units, so batches change size
                engine.submit(_unit(f"s{s}", unit, (unit * 3 + s) % 9, end=unit % 4 == 3, seed=s))
        while engine.pending():
            out.extend(engine.step(use_graphs=use_graphs))
    if use_graphs:
        assert engine.runner._graphs, "no graph was captured"
        assert not engine.runner.misses.counts(), engine.runner.misses.counts()
    return sorted(out, key=lambda r: (r.session_id, r.unit_index))


def test_graph_equals_eager_and_batched_equals_solo() -> None:
    graph = _session_run(True, 8)
    assert graph == _session_run(False, 8)
    assert graph == _session_run(True, 1)


def test_continuous_lanes_in_graphs_equal_whole_units() -> None:
    """Units joining and leaving the lanes between graph replays: the codes of whole units, eager or graphs,
    with room for every session and with lanes full (units wait for one)."""
    whole = _session_run(True, 8)
    assert _session_run(True, 8, continuous=True) == whole
    assert _session_run(True, 2, continuous=True) == whole
    assert _session_run(False, 8, continuous=True) == whole


def test_compiled_continuous_lanes_equal_compiled_whole_units() -> None:
    assert _session_run(True, 8, compile_step=True, continuous=True) == _session_run(True, 8, compile_step=True)


def test_compiled_graph_equals_eager() -> None:
    """torch.compile'd step in the graph: fused kernels round differently, so codes must agree on a
    long common prefix per unit rather than exactly (fp32, tiny)."""
    compiled, eager = _session_run(True, 8, compile_step=True), _session_run(False, 8)
    assert [(r.session_id, r.unit_index) for r in compiled] == [(r.session_id, r.unit_index) for r in eager]
    same = sum(a.codes == b.codes for a, b in zip(compiled, eager, strict=True))
    assert same >= 0.9 * len(eager), f"{same}/{len(eager)} units identical"


def test_graph_matches_cpu_engine_prefix() -> None:
    """The GPU engine follows the same sampling rule: the first unit's codes agree with the CPU engine
    (fp32 kernels differ in rounding, so only a short prefix is required to match)."""
    cpu = TTSEngine(tiny_model(), _cfg())
    gpu = TTSEngine(tiny_model().cuda(), _cfg())
    for e in (cpu, gpu):
        e.open("a", F0, seed=3)
        e.submit(_unit("a", 0, 3))
    (x,), (y,) = cpu.step(), gpu.step(use_graphs=True)
    assert x.codes[:5] == y.codes[:5]
