"""GPU memory of each stage process after load and after warm-up (issue 15; docs/deploy.md §7).

    python build/make_full_checkpoint.py --out /tmp/ckpt --device cuda
    python bench/bench_stage_memory.py --checkpoint /tmp/ckpt --profile deploy/profiles/h200.yaml --json mem.json

Each stage runs in a fresh process of its own, as under Triton (one Python-backend stub per instance): its
bridge is built exactly as `initialize` builds it (model_repository/common/bridges, the profile's dtype,
max_sessions, kv_window and engine_options; own weights only), then warmed up as `initialize` does. After
each phase the child records the device memory in use (`torch.cuda.mem_get_info`: CUDA context included;
run on an otherwise idle GPU), the caching allocator's allocated / reserved / peak bytes, and the bytes of
the per-session tensors the engine preallocates for `max_sessions` (LLM slot KV, TTS slot KV, Token2Wav
cache pool), so that `fixed = used after warm-up - preallocated` is what a process costs before sessions.
Prints a table and writes JSON (`bench/memory_table.py --measured mem.json` turns it into sessions per GPU).
`--cpu` runs the same path on the CPU with zero memory figures (a smoke test on the tiny checkpoint).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "build"))  # `build` is also a PyPI name: its modules are imported by name

from make_model_repository import STAGES  # noqa: E402

GiB = 1024**3


def _settings(stage: str, args: argparse.Namespace) -> Any:
    from make_model_repository import TORCH_ENGINES, DeployProfile

    from model_repository.common.settings import StageSettings

    profile = DeployProfile.load(args.profile)
    return StageSettings(stage=stage, engine_factory=f"{TORCH_ENGINES}:{stage}", checkpoint_dir=str(args.checkpoint),
                         device="cpu" if args.cpu else f"cuda:{args.gpu}", dtype="float32" if args.cpu else profile.dtype, max_sessions=profile.max_sessions,
                         kv_window=profile.kv_window, session_idle_ttl_s=profile.session_idle_ttl_s,
                         engine_options=json.dumps(profile.engine_options.get(stage, {})))


def _memory(device: Any) -> dict[str, int]:
    import torch

    if device.type != "cuda":
        return {"device_used": 0, "allocated": 0, "reserved": 0, "peak_allocated": 0}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"device_used": total - free, "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "peak_allocated": torch.cuda.max_memory_allocated(device)}


def _tensor_bytes(*tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _preallocated(stage: str, bridge: Any) -> int:
    """Bytes of the per-session state the engine allocates up front for max_sessions (+ scratch)."""
    engine = bridge.engine
    if stage == "stage0":
        kv = engine.runner.kv
        pool = _audio_pool(bridge)  # the sessions' audio KV, pooled for max_sessions at the first session
        return _tensor_bytes(*kv.k, *kv.v, *((pool.k, pool.v) if pool is not None else ()))
    if stage == "tts":
        kv = engine.runner.kv
        return _tensor_bytes(*kv.k, *kv.v)
    return _tensor_bytes(*engine.pool.tensors()) if engine.pool is not None else 0


def _audio_pool(bridge: Any) -> Any:
    audio = getattr(getattr(bridge.engine, "frontend", None), "audio", None)
    return getattr(audio, "kv_pool", None)


def child(stage: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from model_repository.common.settings import load_factory

    settings = _settings(stage, args)
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(0, device=device)  # the CUDA context, before anything of the stage
    out: dict[str, Any] = {"stage": stage, "settings": asdict(settings), "context": _memory(device)}
    t0 = time.perf_counter()
    bridge = load_factory(settings.engine_factory)(settings)
    out["load_s"] = time.perf_counter() - t0
    out["after_load"] = _memory(device)
    t0 = time.perf_counter()
    bridge.warm_up(lambda line: print(f"[{stage}] {line}", file=sys.stderr, flush=True))
    out["warm_up_s"] = time.perf_counter() - t0
    out["after_warm_up"] = _memory(device)
    out["preallocated"] = _preallocated(stage, bridge)
    if stage == "stage0":
        out["audio_kv_pooled"] = _audio_pool(bridge) is not None  # then `preallocated` holds the audio KV
    out["fixed"] = out["after_warm_up"]["device_used"] - out["preallocated"]
    out["graph_misses"] = bridge.graph_misses()
    return out


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| stage | load s | warm-up s | used after load | used after warm-up | allocated | reserved | peak "
            "| preallocated for max_sessions | fixed (used - preallocated) |")
    lines = [head, "| --- |" + " ---: |" * 9, ]
    for r in rows:
        load, warm = r["after_load"], r["after_warm_up"]
        lines.append(f"| {r['stage']} | {r['load_s']:.1f} | {r['warm_up_s']:.1f} | {_gib(load['device_used'])} | "
                     f"{_gib(warm['device_used'])} | {_gib(warm['allocated'])} | {_gib(warm['reserved'])} | "
                     f"{_gib(warm['peak_allocated'])} | {_gib(r['preallocated'])} | {_gib(r['fixed'])} |")
    lines.append(f"| **all three** | | | {_gib(sum(r['after_load']['device_used'] for r in rows))} | "
                 f"{_gib(sum(r['after_warm_up']['device_used'] for r in rows))} | | | | "
                 f"{_gib(sum(r['preallocated'] for r in rows))} | {_gib(sum(r['fixed'] for r in rows))} |")
    return "GiB; device used includes each process's CUDA context.\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a full-size checkpoint (make_full_checkpoint.py)")
    ap.add_argument("--profile", type=Path, default=REPO / "deploy" / "profiles" / "h200.yaml")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="smoke test on the CPU (memory figures are 0)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    rows = []
    for stage in args.stages.split(","):  # one fresh process per stage, one after the other
        cmd = [sys.executable, __file__, "--child", stage, "--checkpoint", str(args.checkpoint),
               "--profile", str(args.profile), "--gpu", str(args.gpu), *(["--cpu"] if args.cpu else [])]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    import torch

    gpu = not args.cpu
    result = {"device": torch.cuda.get_device_name(args.gpu) if gpu else "cpu",
              "total": torch.cuda.mem_get_info(args.gpu)[1] if gpu else 0, "profile": str(args.profile), "stages": rows}
    print(table(rows), end="")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
