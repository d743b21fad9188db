"""CUDA graph = eager (model.md §9.6 I10). Needs a CUDA device; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0 import DecodeRules, TokenEvent, UnitDone
from engine.stage0.graphs import DecodeGraphs
from tests.engine.test_stage0_engine import by_session, make_engine, run_schedule
from tests.engine.test_stage0_helpers import TINY, tiny_llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ATOL = 1e-5


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")  # inductor's advice on fp32 matmuls
@pytest.mark.parametrize(("compile_mode", "fuse", "attention"), [
    (None, False, "sdpa"), (None, True, "matmul"), ("default", False, "sdpa"), ("default", True, "matmul"),
    ("max-autotune-no-cudagraphs", True, "matmul"), (None, True, "flex"), ("default", True, "flex")])
def test_graph_decode_step_equals_eager(compile_mode: str | None, fuse: bool, attention: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Qwen3LLM, "decode_attention", attention)  # the eager reference uses the same variant
    model = tiny_llm().cuda()
    if fuse:  # fused q/k/v and gate/up matmuls inside the graph; the eager reference below is unfused
        model.fuse_projections()
    kv = SlotKVCache.allocate(TINY, 4, 64, dtype=torch.float32, device="cuda")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for slot, n in ((0, 5), (1, 17), (2, 30), (3, 9)):
            x = torch.randn(1, n, TINY.hidden_size, generator=gen).cuda()
            model(x, torch.arange(n, device="cuda")[None], torch.tensor([slot], device="cuda"), kv)
    eager_kv = SlotKVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v])
    graphs = DecodeGraphs.create(model, kv, (1, 2, 4), (32,), compile_mode=compile_mode)
    assert graphs is not None
    x = torch.randn(3, TINY.hidden_size, generator=gen).cuda()
    pos, slots = torch.tensor([17, 30, 5]), torch.tensor([1, 2, 0])
    got = graphs.run(x, pos, slots, reach=31).clone()
    with torch.no_grad():
        want = tiny_llm().cuda()(x[:, None], pos[:, None].cuda(), slots.cuda(), eager_kv)[:, 0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    for a, b in zip(kv.k, eager_kv.k, strict=True):
        torch.testing.assert_close(a[:-1, :, :-1], b[:-1, :, :-1], atol=ATOL, rtol=ATOL)  # not scratch/reserved


def test_engine_with_graphs_equals_eager_engine() -> None:
    model = tiny_llm().cuda()
    arrivals = {f"s{i}": 3 * i for i in range(8)}
    rules = DecodeRules(force_listen_count=1)
    runs = []
    for graphs in (True, False):
        engine, events = make_engine(model, rules=rules)
        if graphs:
            engine.runner.graphs = DecodeGraphs.create(model, engine.runner.kv, engine.config.decode_batch_buckets,
                                                       (256, 1024))
            assert engine.runner.graphs is not None
        run_schedule(engine, arrivals, units=6)
        runs.append(events)
    for sid in arrivals:
        got, want = by_session(runs[0], sid), by_session(runs[1], sid)
        key = [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in got]
        assert key == [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator)
                       for e in want]
        for a, b in zip(got, want, strict=True):
            if isinstance(a, TokenEvent) and a.hidden is not None:
                torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)
        assert any(isinstance(e, UnitDone) for e in got)
