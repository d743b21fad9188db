"""Does an MPS client priority keep a latency-bound process at its pace beside a busy one? (issue 14)

Served, the TTS and Token2Wav steps take about twice their alone time beside stage0 under MPS (bench/RESULTS.md,
stop 32). This probe stands in for them: a captured chain of small matmuls (a TTS-like step) replayed and timed,
alone, then beside a process that runs large GEMMs back to back (a stage0-like load), with both at normal priority
with the busy one at `CUDA_MPS_CLIENT_PRIORITY=1` (below normal), (`--busy-threads`) with the busy one capped
by `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, and (`--partitions B:P`) with the GPU's threads split: the busy one capped at
B %, the probe at P % (spatial partitioning: does a share of SMs of its own keep the small step at pace, and what does
the cap cost the busy one?). `--busy-rows N` makes the busy load memory-bound like a stage0 decode step ([N, size]
rows through 8 weight matrices of size², more than the L2 holds) instead of square GEMMs; the busy process reports
its rate (weight passes per second) alone and while the probe runs. Priority and threads are read when a process
creates its CUDA context, so every case runs in fresh processes. Needs a GPU with an MPS control daemon up:

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


def busy(seconds: float, size: int, rows: int) -> None:
    """Square GEMMs back to back (rows 0), or `rows` rows through 8 weight matrices; prints `rate <monotonic s>
    <passes per s>` about every 0.25 s."""
    import torch

    x = torch.randn(rows or size, size, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(8 if rows else 1)]
    for w in ws:
        x @ w
    torch.cuda.synchronize()
    print(f"sms {torch.cuda.get_device_properties(0).multi_processor_count}", flush=True)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    t0, n = time.monotonic(), 0
    while time.monotonic() < end:
        for _ in range(10):
            for w in ws:
                x @ w
        torch.cuda.synchronize()
        n += 10
        now = time.monotonic()
        if now - t0 >= 0.25:
            print(f"rate {now:.3f} {n / (now - t0):.2f}", flush=True)
            t0, n = now, 0


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
    return {"median_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}


def _child(args: argparse.Namespace, role: str, priority: int, threads: int | None = None) -> subprocess.Popen:
    env = {**os.environ, PRIORITY_ENV: str(priority)}
    if threads is not None:  # MPS provisioning: the share of the GPU's threads (SMs) this client may use
        env[THREADS_ENV] = str(threads)
    argv = [sys.executable, __file__, "--role", role, "--iters", str(args.iters), "--seconds", str(args.seconds),
            "--layers", str(args.layers), "--rows", str(args.rows), "--width", str(args.width), "--size", str(args.size),
            "--busy-rows", str(args.busy_rows)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


def _busy_rates(lines: list[str], start: float, end: float) -> dict:
    """The busy process's median rate before the probe started and while it ran (passes per second)."""
    before, during = [], []
    for line in lines:
        if line.startswith("rate "):
            _, at, rate = line.split()
            (during if start <= float(at) <= end else before if float(at) < start else []).append(float(rate))
    return {"busy_rate_alone": statistics.median(before) if before else None,
            "busy_rate_beside": statistics.median(during) if during else None}


def _start_busy(args: argparse.Namespace, priority: int, threads: int | None) -> tuple[subprocess.Popen, int]:
    """The busy process, up; retried: the MPS server refuses new clients while it tears a killed one down."""
    for attempt in range(4):
        load = _child(args, "busy", priority, threads)
        assert load.stdout is not None
        first = load.stdout.readline().strip()
        if first.startswith("sms ") and load.stdout.readline().strip() == "ready":
            return load, int(first.split()[1])
        load.kill()
        load.wait()
        time.sleep(5.0 * (attempt + 1))
    raise RuntimeError("the busy process did not start")


def run_case(args: argparse.Namespace, busy_priority: int | None, busy_threads: int | None = None,
             probe_threads: int | None = None) -> dict:
    """The probe at normal priority (at `probe_threads` % of the GPU's threads), alone (None) or beside the busy
    process at `busy_priority` (and at `busy_threads` %)."""
    load, busy_sms, extra = None, None, {}
    if busy_priority is not None:
        load, busy_sms = _start_busy(args, busy_priority, busy_threads)
        time.sleep(1.0)
    start = time.monotonic()
    try:
        done = _child(args, "probe", 0, probe_threads).communicate(timeout=args.seconds)
        if not done[0].strip():
            raise RuntimeError("the probe printed nothing (its CUDA context was refused?)")
        out = done[0]
    finally:
        end = time.monotonic()
        if load is not None:
            load.kill()
            rest = load.communicate()[0].splitlines()
            extra = {"busy_sms": busy_sms, **_busy_rates(rest, start, end)}
            time.sleep(3.0)  # the MPS server refuses a new client while it still tears a killed one down
    return {**json.loads(out.strip().splitlines()[-1]), **extra}


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
    ap.add_argument("--partitions", default="", help="also split the threads, busy:probe percentages, e.g. 70:30,50:50")
    ap.add_argument("--busy-rows", type=int, default=0, help="busy load: N rows through 8 weight matrices (0: square GEMMs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.role == "busy":
        busy(args.seconds, args.size, args.busy_rows)
        return
    if args.role == "probe":
        print(json.dumps(probe(args.iters, args.layers, args.rows, args.width)), flush=True)
        return
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        print("note: CUDA_MPS_PIPE_DIRECTORY unset: the system daemon's pipe (/tmp/nvidia-mps) or no MPS", flush=True)
    cases = {"alone": (None, None, None), "beside busy, both normal": (0, None, None),
             "beside busy, busy below normal": (1, None, None)}
    cases.update({f"beside busy at {t} % of threads": (0, int(t), None) for t in args.busy_threads.split(",") if t})
    for split in (p for p in args.partitions.split(",") if p):
        b, p = (int(v) for v in split.split(":"))
        cases[f"alone at {p} % of threads"] = (None, None, p)
        cases[f"busy at {b} %, probe at {p} %"] = (0, b, p)
    rows = []
    for name, (pri, threads, probe_threads) in cases.items():
        try:
            r = run_case(args, pri, threads, probe_threads)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:  # one refused case, not the sweep
            rows.append({"case": name, "error": str(exc)})
            print(f"{name:34s} failed: {exc}", flush=True)
            continue
        rows.append({"case": name, **r})
        rates = f"  busy {r['busy_rate_alone']} -> {r['busy_rate_beside']} /s" if "busy_rate_alone" in r else ""
        print(f"{name:34s} probe step median {r['median_ms']:7.3f} ms  p99 {r['p99_ms']:7.3f} ms  sms {r['sms']}"
              f"{rates}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": {k: v for k, v in vars(args).items() if k not in ("role", "json")}, "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
