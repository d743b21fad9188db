"""Where a decode step's GPU time goes (issue 16: the forward at <= 1.2x the bandwidth floor): the kernels of one
replay of the served decode graph.

    python bench/profile_stage0_decode.py --batches 1,32 --context 8192 --attention matmul,flex

Full-size dummy weights (bench_stage0's model, fused projections), `batch` sessions at `context` positions, the
decode CUDA graph as the engine captures it (`--compile default`: the served mode). One replay under the profiler
(kernels inside a graph replay are listed by name); prints the replay's wall time, the GPU time summed over its
kernels, the gaps between them (replay wall - kernel time: launch and tail), the floor, and the top kernels with
the share of the step each takes. `--tiny` runs the tiny model on the CPU (a smoke test: no kernels listed).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_stage0 import engine_args, engine_config, floor_ms, fresh_compile, random_kv, stats, timed  # noqa: E402
from bench.profile_stage0_prefill import profiled_model  # noqa: E402
from engine.model.llm import Qwen3LLM  # noqa: E402
from engine.stage0.graphs import DecodeGraphs  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--attention", default="matmul", help="Qwen3LLM.decode_attention variants: matmul, flex")
    ap.add_argument("--compile", default="default", help="the graphs' compile mode ('' = eager kernels)")
    ap.add_argument("--rows", type=int, default=15, help="kernels listed per row")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="device bytes/s (H200 measured)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    engine_args(args, compile=args.compile or None)  # the engine rows' slot length and buckets; its own slots
    model, cfg, dev, dtype = profiled_model(args.tiny)
    n_params = sum(p.numel() for p in model.parameters())  # bench_stage0's floor (the embedding table counted)
    summary = []
    for b in (int(x) for x in args.batches.split(",")):
        for attention in args.attention.split(","):
            Qwen3LLM.decode_attention = attention
            summary.append((attention, b, *profile_one(model, b, args, dev, dtype),
                            floor_ms(cfg, n_params, 2, b * args.context, args.bandwidth)))
    print("\nattention | batch | replay ms (median / p99) | kernel ms | gaps ms | kernels | floor ms | x floor")
    for attention, b, (med, p99), gpu, count, floor in summary:
        print(f"{attention} | {b} | {med:.2f} / {p99:.2f} | {gpu:.2f} | {med - gpu:.2f} | {count} | {floor:.2f} | "
              f"{med / floor:.2f}")


def profile_one(model: Qwen3LLM, b: int, args: argparse.Namespace, dev: torch.device,
                dtype: torch.dtype) -> tuple[tuple[float, float], float, int]:
    """((median, p99) replay wall ms, summed kernel ms of one replay, kernels per replay) for b rows."""
    config, rules = engine_config(b, args, dev)
    kv = random_kv(model.cfg, b, config.slot_len(rules), dev, dtype)
    mode = args.compile
    fresh_compile(mode)
    graphs = DecodeGraphs.create(model, kv, config.decode_batch_buckets, config.decode_kv_buckets, compile_mode=mode,
                                 eager_replay=dev.type != "cuda", compile_dynamic=config.compile_dynamic)
    assert graphs is not None
    x = torch.randn(b, model.cfg.hidden_size, dtype=dtype, device=dev)
    pos, slots = torch.full((b,), args.context), torch.arange(b)

    def step() -> None:
        graphs.run(x, pos, slots, args.context + 1)

    with torch.no_grad():
        wall = timed(step, args.iters, 5, dev)
        if dev.type != "cuda":
            return wall, 0.0, 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            kernels[ev.name].append(ev.device_time_total / 1e3)
    total = sum(sum(v) for v in kernels.values())
    count = sum(len(v) for v in kernels.values())
    print(f"\n== {Qwen3LLM.decode_attention} decode, batch {b}, context {args.context}: replay {wall[0]:.2f} ms, "
          f"{count} kernels, {total:.2f} ms of kernel time ==")
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:args.rows]:
        t = sum(times)
        print(f"{t:7.3f} ms {100 * t / total:5.1f} %  x{len(times):<4d} {stats(times)[0] * 1e3:7.1f} us  {name[:110]}")
    return wall, total, count


if __name__ == "__main__":
    main()
