"""engine/cuda_graph.py, the one capture helper of every engine (issue 19). CUDA only (bench/h200/gpu_checks.sh)."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graph import StaticGraph, capture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_captured_call_replays_what_eager_computes_on_new_inputs() -> None:
    w = torch.randn(64, 64, device="cuda")
    x = torch.randn(8, 64, device="cuda")

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.relu(a @ w) + b,)

    g = StaticGraph(fn, (x.clone(), torch.zeros(8, 64, device="cuda")), torch.cuda.graph_pool_handle())
    for _ in range(3):
        a, b = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g.run((a, b))[0], fn(a, b)[0])
    with pytest.raises(RuntimeError, match="shape drift"):
        g.run((torch.randn(4, 64, device="cuda"), b))


def test_an_input_read_in_place_must_be_the_captured_tensor() -> None:
    pool = torch.zeros(4, 16, device="cuda")

    def fn(x: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kv.add_(x)  # the graph writes the pool where it lies
        return (kv.sum(0),)

    x = torch.ones(4, 16, device="cuda")
    g = StaticGraph(fn, (x.clone(), pool), None, in_place=1)
    before = pool.clone()
    g.run((x, pool))
    torch.testing.assert_close(pool, before + 1)
    with pytest.raises(RuntimeError, match="in place"):
        g.run((x, pool.clone()))


def test_reset_runs_before_every_warm_up_and_the_capture_but_is_not_captured() -> None:
    t = torch.zeros((), device="cuda")
    resets = []

    def step() -> torch.Tensor:
        return t.add_(1)

    graph, _ = capture(step, warmup=3, reset=lambda: (resets.append(1), t.zero_()))
    assert len(resets) == 4
    t.fill_(10)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert t.item() == 12  # the replay only adds: the reset is not in the graph
