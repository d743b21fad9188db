"""Where an engine step's time goes outside the forward (issue 16: engine overhead <= 15 %, 32 sessions' unit
prefill <= 25 ms): the Stage0 engine's `step()` cut into its parts.

    python bench/profile_stage0_engine.py --batches 1,32 --contexts 2048,8192 [--slots 32]

bench_stage0's engine rows (full-size dummy weights, compiled graphs as served, merged unit close, scripted
speak units, the real batched audio front end), with each part of the step wrapped in a timer that synchronises
the device before and after it, so a part's figure holds its own GPU work (the parts nest: `forward` holds
`prefill graphs`). Prints, per step kind (prefill: units start; decode: every session feeds a token), the step's
median wall ms and each part's median ms per step, then one step of each kind under torch.profiler (the top
host ops by self CPU time and the top kernels). `--tiny` runs the tiny model on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.stage0.loop as loop  # noqa: E402
from bench.bench_stage0 import FULL, TINY, dummy_init, engine_args, engine_at_context, unit_steps  # noqa: E402
from engine.model.llm import Qwen3LLM  # noqa: E402
from engine.stage0 import Stage0Engine  # noqa: E402


class Parts:
    """Synchronised wall ms of wrapped callables, summed per step."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.step: dict[str, float] = defaultdict(float)
        self.undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - any signature
            self.sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.step[label] += (time.perf_counter() - t0) * 1e3

        self.undo.append((owner, name, owner.__dict__.get(name, _CLASS_ATTR)))
        setattr(owner, name, timed)

    def restore(self) -> None:
        """Unwraps everything (the module functions would otherwise stay wrapped for the next engine)."""
        for owner, name, old in reversed(self.undo):
            if old is _CLASS_ATTR:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.undo.clear()


_CLASS_ATTR = object()  # the wrapped name was the class's (a method), not the instance's own


def instrument(engine: Stage0Engine, parts: Parts) -> None:
    sched, runner = engine.scheduler, engine.runner
    parts.wrap(loop, "compact", "compact")
    for name in ("_prepare", "_encode_audio", "_encode_frames", "_row", "_postprocess", "_sample", "_act"):
        parts.wrap(sched, name, name.lstrip("_"))
    parts.wrap(sched.recovery, "forward", "forward")
    parts.wrap(runner, "_decode", "decode rows")
    parts.wrap(runner, "_eager", "eager rows")
    parts.wrap(runner, "logits", "logits")
    if runner.prefill_graphs is not None:
        parts.wrap(runner.prefill_graphs, "run", "prefill graphs")
    if runner.graphs is not None:
        parts.wrap(runner.graphs, "run", "decode graphs")
    parts.wrap(sched.history_ring, "sync", "history sync")
    parts.wrap(loop, "sample", "sample kernels")
    parts.wrap(loop, "read_back", "read back")
    parts.wrap(sched, "emit", "emit")


def profile_engine(engine: Stage0Engine, sids: list[str], config: object, args: argparse.Namespace,
                   sync: Callable[[], None], dev: torch.device) -> None:
    parts = Parts(sync)
    instrument(engine, parts)
    try:
        run_steps(engine, sids, config, args, sync, dev, parts)
    finally:
        parts.restore()


def run_steps(engine: Stage0Engine, sids: list[str], config: object, args: argparse.Namespace,
              sync: Callable[[], None], dev: torch.device, parts: Parts) -> None:
    walls: dict[str, list[float]] = defaultdict(list)
    by_part: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    profiled: set[str] = set()
    for unit, kind in unit_steps(engine, sids, config, args.units):
        parts.step.clear()
        if unit == args.units and kind and kind not in profiled and dev.type == "cuda":
            profiled.add(kind)
            profile_step(engine, kind, args, sync)
            continue
        sync()
        t0 = time.perf_counter()
        busy = engine.step()
        sync()
        if busy and unit and kind:
            walls[kind].append((time.perf_counter() - t0) * 1e3)
            for label, ms in parts.step.items():
                by_part[kind][label].append(ms)
    for kind, w in walls.items():
        print(f"  {kind}: {len(w)} steps, step median {statistics.median(w):.2f} ms")
        for label, ms in sorted(by_part[kind].items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"    {label:16s} {statistics.median(ms):8.2f} ms  (calls in {len(ms)} of {len(w)} steps)")


def profile_step(engine: Stage0Engine, kind: str, args: argparse.Namespace, sync: Callable[[], None]) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        engine.step()
        sync()
    avg = prof.key_averages()
    print(f"\n  -- one {kind} step under torch.profiler: top host ops (self CPU) --")
    print(avg.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print("  -- top kernels (self device time) --")
    print(avg.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--units", type=int, default=3, help="timed units per session (a warm-up unit first)")
    ap.add_argument("--compile", default="default",
                    help="the graphs' compile mode ('' = eager kernels) where --profile is ''; else the profile's")
    ap.add_argument("--rows", type=int, default=25, help="ops listed per profiled step")
    ap.add_argument("--no-engine-frontend", action="store_true", help="random unit embeddings, no audio encoder")
    ap.add_argument("--slots", type=int, default=0,
                    help="the engine's max_sessions (a served engine's: 32 in the h200 profile); 0: the batch")
    ap.add_argument("--decode-attention", default="flex", choices=("flex", "matmul"),
                    help="decode attention of the engine's graphs where --profile is '' (else the profile's)")
    ap.add_argument("--profile", default=str(Path(__file__).resolve().parents[1] / "deploy/profiles/h200.yaml"),
                    help="the engine's stage0 kernel options from this deploy profile, as served ('': the options "
                         "above)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    cfg = TINY if args.tiny else FULL
    engine_args(args, compile=args.compile or None, engine_units=args.units, prefill_attention=["auto"],
                decode_attention=[args.decode_attention], profile=args.profile or None)
    with torch.device(dev):
        model = Qwen3LLM(cfg).to(dtype).eval()
    dummy_init(model)
    model.fuse_projections()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for context in (int(c) for c in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            args.context = context
            print(f"\n== {b} sessions at {context} retained positions ==")
            engine, sids, config = engine_at_context(model, cfg, b, args, dev, dtype)
            profile_engine(engine, sids, config, args, sync, dev)
            del engine
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
