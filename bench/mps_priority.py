"""Does an MPS client priority keep a latency-bound process at its pace beside a busy one? (issue 14)

Served, the TTS and Token2Wav steps take about twice their alone time beside stage0 under MPS (bench/RESULTS.md,
stop 32). This probe stands in for them: a captured chain of small matmuls (a TTS-like step) replayed and timed,
alone, then beside a process that runs large GEMMs back to back (a stage0-like load), with both at normal priority
with the busy one at `CUDA_MPS_CLIENT_PRIORITY=1` (below normal), and (`--busy-threads`) with the busy one capped
by `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. Both are read when a process creates its CUDA context, so every case runs in
fresh processes. Needs a GPU with an MPS control daemon up:

    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    nvidia-cuda-mps-control -d && python bench/mps_priority.py --json out.json; echo quit | nvidia-cuda-mps-control
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def busy(seconds: float, size: int) -> None:
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    a @ b
    torch.cuda.synchronize()
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()


def probe(iters: int, layers: int, rows: int, width: int) -> dict:
    import torch

    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(width, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5 for _ in range(layers)]

    def step() -> torch.Tensor:
        h = x
        for w in ws:
            h = torch.nn.functional.silu(h @ w)
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return {"median_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))]}


def _child(args: argparse.Namespace, role: str, priority: int, threads: int | None = None) -> subprocess.Popen:
    env = {**os.environ, PRIORITY_ENV: str(priority)}
    if threads is not None:  # MPS provisioning: the share of the GPU's threads (SMs) this client may use
        env[THREADS_ENV] = str(threads)
    argv = [sys.executable, __file__, "--role", role, "--iters", str(args.iters), "--seconds", str(args.seconds),
            "--layers", str(args.layers), "--rows", str(args.rows), "--width", str(args.width), "--size", str(args.size)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


def run_case(args: argparse.Namespace, busy_priority: int | None, busy_threads: int | None = None) -> dict:
    """The probe at normal priority, alone (None) or beside the busy process at `busy_priority` (and at
    `busy_threads` % of the GPU's threads)."""
    load = None
    if busy_priority is not None:
        load = _child(args, "busy", busy_priority, busy_threads)
        assert load.stdout is not None
        if load.stdout.readline().strip() != "ready":
            raise RuntimeError("the busy process did not start")
        time.sleep(1.0)
    try:
        out = _child(args, "probe", 0).communicate(timeout=args.seconds)[0]
    finally:
        if load is not None:
            load.kill()
            load.wait()
            time.sleep(3.0)  # the MPS server refuses a new client while it still tears a killed one down
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("main", "busy", "probe"), default="main")
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=60.0, help="the busy process's lifetime (an upper bound)")
    ap.add_argument("--layers", type=int, default=48, help="matmuls in the probe's step")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--size", type=int, default=8192, help="the busy process's square GEMM")
    ap.add_argument("--busy-threads", default="", help="also beside the busy process capped at these percentages of threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.role == "busy":
        busy(args.seconds, args.size)
        return
    if args.role == "probe":
        print(json.dumps(probe(args.iters, args.layers, args.rows, args.width)), flush=True)
        return
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        print("note: CUDA_MPS_PIPE_DIRECTORY unset: the system daemon's pipe (/tmp/nvidia-mps) or no MPS", flush=True)
    cases = {"alone": (None, None), "beside busy, both normal": (0, None), "beside busy, busy below normal": (1, None)}
    cases.update({f"beside busy at {t} % of threads": (0, int(t)) for t in args.busy_threads.split(",") if t})
    rows = []
    for name, (pri, threads) in cases.items():
        r = run_case(args, pri, threads)
        rows.append({"case": name, **r})
        print(f"{name:34s} probe step median {r['median_ms']:7.3f} ms  p99 {r['p99_ms']:7.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": {k: v for k, v in vars(args).items() if k not in ("role", "json")}, "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
