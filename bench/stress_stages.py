"""Stress the served path: many sessions through the gateway's `StagedTritonRuntime` on a real tritonserver.

Each run starts its own tritonserver (stage models, real engines, tiny checkpoint on CPU by default), drives
`--sessions` concurrent sessions (each its own gRPC stream): open, units back to back, a cancel in the middle
of every other session, close, and a second incarnation of every fourth session (stop/start), then stops the
server (the models unload) and reads its log for the marks a dying Python-backend stub leaves. A run fails on
any crash mark, a unit that never finished, or a stage0 unit left without its `unit_done`.

  .venv/bin/python bench/stress_stages.py --runs 20 --sessions 32 --out stress.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "build")]

from make_model_repository import DeployProfile, build_repository  # noqa: E402
from make_tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

from gateway.runtime.base import Fence, RuntimeFailure, SessionKey, UnitDone, UnitSubmission  # noqa: E402
from gateway.runtime.stages import STAGES, StagedTritonRuntime  # noqa: E402
from serve.launcher import DEFAULT_CACHE_DIR, TritonServer, locate_tritonserver  # noqa: E402

CRASH_MARKS = ("corrupted size", "Reference count error", "not healthy", "double linked list", "fastbin",
               "malloc()", "Segmentation fault", "double free")
SCRIPTED = REPO / "tests" / "e2e" / "profiles" / "scripted.yaml"
FIRST_UNIT, UNIT = 16_480, 16_000
UNIT_TIMEOUT_S = 120.0


def _free_ports() -> Any:
    import socket  # noqa: PLC0415

    from serve.launcher import TritonPorts  # noqa: PLC0415

    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return TritonPorts(http=ports[0], grpc=ports[1], metrics=ports[2])


def _pcm(index: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed * 1000 + index)
    return (rng.standard_normal(FIRST_UNIT if index == 0 else UNIT) * 0.1).astype(np.float32).tobytes()


async def _one_session(rt: StagedTritonRuntime, key: SessionKey, units: int, cancel_at: int | None,
                       stats: dict[str, int]) -> None:
    epoch = 0
    await rt.open(key, Fence(1, epoch), {"seed": key.correlation_id})
    done: list[UnitDone] = []
    all_done = asyncio.Event()
    final_epoch = 0 if cancel_at is None else 1

    async def collect() -> None:
        async for ev in rt.events(key):
            if isinstance(ev, UnitDone) and ev.epoch == epoch:
                done.append(ev)
                if ev.epoch == final_epoch and len(done) >= units - (cancel_at or 0):
                    all_done.set()

    collector = asyncio.create_task(collect())
    for i in range(units):
        if i == cancel_at:
            await rt.cancel(key, Fence(1, epoch, i), Fence(1, epoch + 1, i))
            epoch += 1
            done.clear()
            stats["cancels"] += 1
        await asyncio.wait_for(rt.append(key, Fence(1, epoch, i + 1), UnitSubmission(i, _pcm(i, key.correlation_id))),
                               UNIT_TIMEOUT_S)
        stats["units"] += 1
    expected = units - (cancel_at or 0)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_done.wait(), UNIT_TIMEOUT_S)
    if len(done) < expected:
        stats["missing_unit_done"] += expected - len(done)
    await rt.close(key, Fence(1, epoch))
    collector.cancel()


async def _traffic(grpc_url: str, sessions: int, units: int, seed: int) -> dict[str, int]:
    stats = {"units": 0, "cancels": 0, "sessions": 0, "missing_unit_done": 0, "errors": 0}
    rt = StagedTritonRuntime(grpc_url)

    async def run(k: int) -> None:
        for incarnation in range(2 if k % 4 == 0 else 1):  # every fourth session starts again (stop/start)
            key = SessionKey(f"s{k}-{incarnation}", seed * 10_000 + k * 10 + incarnation + 1)
            try:
                await _one_session(rt, key, units, units // 2 if k % 2 else None, stats)
                stats["sessions"] += 1
            except (RuntimeFailure, TimeoutError) as exc:
                stats["errors"] += 1
                print(f"  session {key.session_id}: {type(exc).__name__}: {exc}", flush=True)

    await asyncio.gather(*(run(k) for k in range(sessions)))
    await rt.aclose()
    return stats


async def one_run(index: int, args: argparse.Namespace, repo: Path, workdir: Path) -> dict[str, Any]:
    log = workdir / f"triton-{index}.log"
    server = TritonServer(locate_tritonserver(DEFAULT_CACHE_DIR), repo, STAGES, _free_ports(), log)
    t0 = time.monotonic()
    server.start()
    try:
        await asyncio.to_thread(server.wait_ready, args.ready_timeout, lambda _m: None)
        stats = await _traffic(server.grpc_url, args.sessions, args.units, index)
    finally:
        await asyncio.to_thread(server.stop)  # graceful: the models unload, which once crashed stubs too
    text = log.read_text(errors="replace")
    crashes = [m for m in CRASH_MARKS if m in text]
    ok = not crashes and not stats["missing_unit_done"] and not stats["errors"]
    return {"run": index, "ok": ok, "crash_marks": crashes, "seconds": round(time.monotonic() - t0, 1), **stats}


async def _runs(args: argparse.Namespace, repo: Path, workdir: Path) -> list[dict[str, Any]]:
    results = []
    for i in range(args.runs):
        res = await one_run(i, args, repo, workdir)
        results.append(res)
        print(json.dumps(res), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--units", type=int, default=8, help="units per session (scripted: units 4, 5 speak)")
    ap.add_argument("--profile", type=Path, default=SCRIPTED)
    ap.add_argument("--checkpoint", type=Path, help="default: the seeded tiny checkpoint, built here")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="stress-stages-"))
    ckpt = args.checkpoint or build_tiny_checkpoint(workdir / "ckpt", 0, vision=False)
    profile = DeployProfile.load(args.profile, max_sessions=args.sessions)
    repo = build_repository(str(ckpt), profile, workdir / "models", models=STAGES)
    results = asyncio.run(_runs(args, repo, workdir))  # one event loop: grpc.aio binds to the first one
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    report = {"commit": commit.strip(), "sessions": args.sessions, "units": args.units, "runs": results,
              "failed_runs": sum(not r["ok"] for r in results)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"\nruns {len(results)}  failed {report['failed_runs']}  crash marks "
          f"{sum(len(r['crash_marks']) for r in results)}  units {sum(r['units'] for r in results)}  "
          f"cancels {sum(r['cancels'] for r in results)}  sessions {sum(r['sessions'] for r in results)}")
    return 1 if report["failed_runs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
