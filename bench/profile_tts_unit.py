"""Where a TTS unit's GPU time goes (issue 14: the TTS step is the longest stage step of the served figure):
the kernels of the 24 single-code step replays of one unit, as served (compiled decoder layer + CUDA graphs).

    python bench/profile_tts_unit.py --batches 1,8

Full-size dummy weights (bench_tts's model), every row a mid-turn unit of `--rows` text rows. Per batch it
prints the wall time of the unit's step replays, the GPU time the profiler saw, kernels per step, and the top
kernels by GPU time: a GPU time near the wall time with many short kernels says the step is launch/latency
bound, not bandwidth bound (its floor is the 0.4 GB of weights read per step). `--tiny` runs on the CPU
(a smoke test: no graphs, CPU ops listed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_tts import FENCE, engine_unit, make_cfg, make_model, replays, requests  # noqa: E402
from engine.stage1.config import TTSEngineConfig  # noqa: E402
from engine.stage1.tts_engine import TTSEngine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rows", type=int, default=16, help="text rows per unit")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per batch")
    ap.add_argument("--no-compile", action="store_true", help="graphs of the eager step (not as served)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batches = [int(x) for x in args.batches.split(",")]
    cfg = make_cfg(args.tiny)
    model = make_model(cfg, device, dtype)
    ecfg = TTSEngineConfig(max_sessions=max(batches), max_batch=max(batches), max_turn_positions=1024,
                           compile_step=device == "cuda" and not args.no_compile)
    engine = TTSEngine(model, ecfg)
    for b in range(max(batches)):
        engine.open(f"s{b}", FENCE, seed=b)
    summary = []
    for b in batches:
        unit = engine_unit(engine, requests(cfg, b, args.rows, device), device == "cuda")
        for _ in range(3):
            unit()  # captures (and compiles) this batch bucket's graphs
        run = replays(engine, b) if device == "cuda" else unit
        summary.append((b, *profile_one(run, b, args, device)))
    print("\nbatch | wall ms per step | GPU ms per step | kernels per step (CPU: ops) | mean kernel us")
    for b, wall, gpu, kernels in summary:
        print(f"{b} | {wall:.3f} | {gpu:.3f} | {kernels:.0f} | {1e3 * gpu / max(kernels, 1):.1f}")


def profile_one(run, b: int, args: argparse.Namespace, device: str) -> tuple[float, float, float]:
    """(wall ms, GPU ms, kernels) per single-code step of `run` (24 steps on CUDA, a whole unit on the CPU)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps = 24 if cuda else 1
    for _ in range(3):
        run()
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        run()
    sync()
    wall = (time.perf_counter() - t0) / 5 * 1e3 / steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        run()
        sync()
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps  # us -> ms
        count = len(kernels) / steps
    else:
        gpu, count = float("nan"), float(len(events))
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\n== batch {b}: {wall:.3f} ms per step (wall), {gpu:.3f} ms GPU, {count:.0f} kernels per step ==")
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=80))
    return wall, gpu, count


if __name__ == "__main__":
    main()
