"""Regional compilation (engine/model/layers.py `compile_layers`): one decoder layer compiled once serves
every layer and every shape bucket, and matches the eager forward.

Runs inductor's CPU backend (needs a C compiler): the TTS warm-up compiles its step ahead per bucket, the
Stage0 graph sets replay eagerly; the compile count is dynamo's (`unique_graphs`), reset per test.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from engine.model.layers import compile_layers
from engine.model.llm import SlotKVCache
from engine.stage0.graphs import DecodeGraphs
from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import TTSUnitResult
from tests.engine.test_stage0_helpers import TINY, tiny_llm
from tests.engine.test_stage0_prefill_graphs import ATOL, _check_prefill, _copy, _filled_kv
from tests.engine.test_tts_engine import F0, _cfg, _unit
from tests.engine.test_tts_helpers import tiny_model, with_eos_bias

pytestmark = pytest.mark.slow


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()  # no compiled layer left from another test, and every count starts at zero
    counters.clear()


def test_compiled_layers_equal_eager_forward() -> None:
    """Same model, same inputs: the compiled layers give the eager hidden states (fp32, CPU)."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(2)
    kv, eager_kv = (SlotKVCache.allocate(model.cfg, 4, 128, dtype=torch.float32) for _ in range(2))
    x = torch.randn(3, 7, model.cfg.hidden_size, generator=gen)
    pos, slots = torch.arange(5, 12).expand(3, 7), torch.tensor([2, 0, 3])
    with torch.no_grad():
        got = model(x, pos, slots, kv, kv_limit=64, layer_fn=compile_layers())
        want = model(x, pos, slots, eager_kv, kv_limit=64)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    for a, b in zip(kv.k + kv.v, eager_kv.k + eager_kv.v, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
    assert compiled_graphs() == 1  # two layers, one compile


def _sessions(engine: TTSEngine) -> list[TTSUnitResult]:
    out: list[TTSUnitResult] = []
    for s in range(5):
        engine.open(f"s{s}", F0, seed=10 + s)
    for unit in range(4):
        for s in range(5):
            if (unit + s) % 4 != 3:  # sessions skip units, so batches change size
                engine.submit(_unit(f"s{s}", unit, (unit * 3 + s) % 9, end=unit % 4 == 3, seed=s))
        while engine.pending():
            out.extend(engine.step())
    return sorted(out, key=lambda r: (r.session_id, r.unit_index))


def test_tts_warm_up_compiles_batch_one_and_many_once_each() -> None:
    """Warm-up over 4 batch x 5 kv buckets compiles the layer and the logits + sampling head twice each
    (batch 1, batch > 1: sizes 0 and 1 specialise); serving afterwards compiles nothing; codes follow the
    eager engine."""
    cfg = _cfg(max_turn_positions=1024, compile_step=True)
    compiled = TTSEngine(with_eos_bias(tiny_model(), 6.0), cfg)
    assert len(compiled.runner.kv_buckets()) == 5
    compiled.runner.warm_up()
    assert compiled_graphs() == 4
    got = _sessions(compiled)
    assert compiled_graphs() == 4, "a served batch recompiled"
    want = _sessions(TTSEngine(with_eos_bias(tiny_model(), 6.0), _cfg(max_turn_positions=1024)))
    assert [(r.session_id, r.unit_index) for r in got] == [(r.session_id, r.unit_index) for r in want]
    same = sum(a.codes == b.codes for a, b in zip(got, want, strict=True))
    assert same >= 0.9 * len(want), f"{same}/{len(want)} units identical"


def test_stage0_graph_sets_compile_once_per_layout_and_batch_class() -> None:
    """Decode (dense) and prefill (gathered) sets over 3 batch buckets x 2 spans (x 3 lengths) compile
    the layer 4 times in all, and match the eager forward."""
    _check_prefill("cpu", "default", eager_replay=True)  # 18 prefill shapes, compared with eager
    assert compiled_graphs() == 2
    model = tiny_llm().fuse_projections()
    kv = _filled_kv(model, "cpu", {0: 5, 1: 17, 2: 30, 3: 9}, max_len=64)
    eager_kv = _copy(kv)
    graphs = DecodeGraphs.create(model, kv, (1, 2, 4), (32,), compile_mode="default", eager_replay=True)
    assert graphs is not None and len(graphs.steps) == 3 * 2
    assert compiled_graphs() == 4
    x = torch.randn(3, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    pos, slots = torch.tensor([17, 30, 5]), torch.tensor([1, 2, 0])
    got = graphs.run(x, pos, slots, reach=31).clone()
    with torch.no_grad():
        want = tiny_llm()(x[:, None], pos[:, None], slots, eager_kv)[:, 0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert compiled_graphs() == 4


def test_stage0_compiled_layer_rounds_as_eager_and_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage0's compiled layer (graphs.compile_step) runs with inductor's `emulate_precision_casts`, so a row's bits
    do not follow the fusion of the graph it runs in (decode, prefill or shared pass: on an H100 a shared pass's rows
    differed from split's without it, bench/RESULTS.md stop 45); `compile_layers` alone (the TTS) keeps inductor's
    default. Read inside the compiled call, where inductor lowers the graph."""
    import torch._inductor.config as inductor_config

    from engine.stage0.graphs import compile_step

    seen: list[bool] = []

    def fake_compile(fn, **_: object):  # noqa: ANN001, ANN202 - torch.compile's signature
        return lambda *args: seen.append(inductor_config.emulate_precision_casts)

    monkeypatch.setattr(torch, "compile", fake_compile)
    stage0, plain = compile_step("default"), compile_layers("default")
    assert stage0 is not None
    stage0(), plain(), stage0()
    assert seen == [True, False, True] and inductor_config.emulate_precision_casts is False
