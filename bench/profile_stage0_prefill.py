"""Where a batched unit prefill's GPU time goes (issue 16): the kernels of one Stage0 prefill forward.

    python bench/profile_stage0_prefill.py --batches 1,8,32 --context 8192 [--flex]

Full-size dummy weights (bench_stage0's model), `batch` sessions with `context` retained positions each, one
13-position unit (the merged close + `<unit>` + 10 audio embeddings) per session through the gathered-slot
forward the prefill graphs capture (eager kernels here, so the profiler names them). Prints the wall time of
the forward and the top kernels by GPU time. `--tiny` runs the tiny model on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.bench_stage0 import FULL, MERGED_PREFILL, TINY, dummy_init, quantized, random_kv  # noqa: E402
from engine.config import LLMConfig  # noqa: E402
from engine.model import flex  # noqa: E402
from engine.model.llm import Qwen3LLM  # noqa: E402

SDPA_SETS = {"efficient": [SDPBackend.EFFICIENT_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
             "math": [SDPBackend.MATH], "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                     SDPBackend.MATH]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=20, help="kernels listed per batch")
    ap.add_argument("--sdpa", default="default",
                    help="SDPA kernel sets to compare: default (PyTorch's choice), efficient, flash, math, no-cudnn")
    ap.add_argument("--flex", action="store_true",
                    help="the rows attend over the slot KV with FlexAttention (the served prefill), not a gathered copy")
    ap.add_argument("--keys-per-split", default="",
                    help="with --flex: split lengths of the decoding kernel to sweep (Qwen3LLM.flex_keys_per_split; 0: torch's)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    model, cfg, dev, dtype = profiled_model(args.tiny)
    summary = []
    programs = [int(p) for p in args.keys_per_split.split(",") if p] or [flex.KEYS_PER_SPLIT]
    for b in (int(x) for x in args.batches.split(",")):
        for name in args.sdpa.split(","):
            for keys in programs:
                model.flex_keys_per_split = keys
                try:
                    with sdpa_kernel(SDPA_SETS[name]) if name != "default" else contextlib.nullcontext():
                        summary.append((name, keys, b, *profile_one(model, cfg, b, args, dev, dtype)))
                except RuntimeError as exc:  # e.g. no kernel of the set takes this mask on this device
                    print(f"\n== batch {b}, sdpa {name}: {exc} ==")
    print("\nsdpa | flex keys per split | batch | eager wall ms | GPU ms | attention ms | KV gather ms")
    for name, keys, b, wall, gpu, attn, gather in summary:
        print(f"{name} | {keys if args.flex else '-'} | {b} | {wall:.1f} | {gpu:.1f} | {attn:.1f} | {gather:.1f}")


def profiled_model(tiny: bool) -> tuple[Qwen3LLM, LLMConfig, torch.device, torch.dtype]:
    """bench_stage0's model with fused projections: full size in bf16 on the GPU, or tiny in fp32 on the CPU."""
    dev = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    cfg = TINY if tiny else FULL
    with torch.device(dev):
        model = Qwen3LLM(cfg).to(dtype).eval()
    dummy_init(model)
    model.fuse_projections()
    return model, cfg, dev, dtype


def profile_one(model: Qwen3LLM, cfg: LLMConfig, b: int, args: argparse.Namespace, dev: torch.device,
                dtype: torch.dtype) -> tuple[float, float, float, float]:
    """(wall ms of the eager forward, its GPU ms, of which attention and the KV gather) for b rows."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if dev.type == "cuda" else [])
    kv = random_kv(cfg, b, args.context + 64, dev, dtype)
    span, n = quantized(args.context + MERGED_PREFILL), MERGED_PREFILL
    x = torch.randn(b, n, cfg.hidden_size, dtype=dtype, device=dev)
    pos = (args.context + torch.arange(n, device=dev))[None].expand(b, n).contiguous()
    slots = torch.arange(b, device=dev)
    valid = torch.ones(b, n, dtype=torch.bool, device=dev)

    def forward() -> None:
        model(x, pos, slots, kv, valid=valid, kv_limit=span, flex=args.flex)

    with torch.no_grad():
        for _ in range(3):
            forward()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            forward()
        sync()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        with torch.profiler.profile(activities=activities) as prof:
            forward()
            sync()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(f"\n== batch {b}, context {args.context}, {n} positions per row{', flex' if args.flex else ''}: eager "
          f"forward {wall:.1f} ms ==")
    table = prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=70)
    print(table)
    own = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"  # per-op name since torch 2.4
    ops = {e.key: getattr(e, own) / 1e3 for e in prof.key_averages()}  # ms
    attention = sum(v for k, v in ops.items() if (k.startswith("aten::_") and "attention" in k)
                    or k.startswith("triton_tem_fused_flex"))
    return wall, _total_ms(table), attention, ops.get("aten::index", 0.0)


def _total_ms(table: str) -> float:
    """The profiler's own GPU (else CPU) total, as its table prints it."""
    m = re.search(r"Self CUDA time total: ([\d.]+)(us|ms|s)\b", table) or re.search(
        r"Self CPU time total: ([\d.]+)(us|ms|s)\b", table)
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)] if m else float("nan")

if __name__ == "__main__":
    main()
