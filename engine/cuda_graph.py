"""CUDA-graph capture, one way for every engine (stage0 steps, the TTS runner, Token2Wav's graphs).

`capture` warms a call up on a side stream first: cuBLAS/cuFFT plans, the caching allocator's blocks and
a compile (torch.compile) must exist before capture, since none of them can be created inside a graph.
`StaticGraph` is a captured call over fixed input tensors: `run` copies new inputs into them, replays,
and returns the graph's fixed outputs (scratch: the caller copies them out before the next replay).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], *, pool: object = None, warmup: int = 2,
            reset: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` `warmup` times on a side stream, then capture one call in `pool` -> (graph, its outputs).
    `reset` runs before each warm-up call and before the capture, outside the graph (e.g. rewinding a step
    counter the graph itself must not rewind)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            if reset is not None:
                reset()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    # no garbage collection while capturing: a collected cycle that holds an older CUDAGraph destroys it
    # mid-capture, which CUDA forbids and which invalidates this capture (torch stopped collecting on entry)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class StaticGraph:
    """`fn(*inputs)` captured over static `inputs` (already filled). The input at `in_place`, if any, is
    read and written by the graph where it lies (e.g. a KV pool): callers pass that very tensor."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...],
                 pool: object, in_place: int | None = None) -> None:
        self.inputs, self.in_place = inputs, in_place
        self.graph, self.outputs = capture(lambda: fn(*inputs), pool=pool)

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for i, (dst, src) in enumerate(zip(self.inputs, inputs, strict=True)):
            if i == self.in_place:
                if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
                    raise RuntimeError("graph input read in place was not passed in place")
                continue
            if dst.shape != src.shape:
                raise RuntimeError(f"graph input shape drift: {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src)
        self.graph.replay()
        return self.outputs
