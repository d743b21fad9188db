"""Where a batched unit prefill's GPU time goes (issue 16): the kernels of one Stage0 prefill forward.

    python bench/profile_stage0_prefill.py --batches 1,8,32 --context 8192 [--flex] [--slots 32]

Full-size dummy weights (bench_stage0's model), `batch` sessions with `context` retained positions each, one
13-position unit (the merged close + `<unit>` + 10 audio embeddings) per session through the gathered-slot
forward the prefill graphs capture (eager kernels here, so the profiler names them). Prints the wall time of
the forward and the top kernels by GPU time. `--slots` sizes the KV cache as a served engine's (max_sessions),
the batch's rows among them: flex attends over every slot (engine/model/flex.py), so a cache of the batch's own
slots understates a served prefill of a few rows; with `--flex` the table then also gives the split's partial
results per layer (`split_partials_bytes`) and the GPU time of the compiled flex call's other kernels, its
reduction of those partials. `--tiny` runs the tiny model on the CPU (a smoke test).
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
from engine.model.llm import Qwen3LLM, SlotKVCache  # noqa: E402

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
                    help="with --flex: split lengths of the decoding kernel to sweep "
                         "(Qwen3LLM.flex_prefill_keys_per_split; 0: torch's)")
    ap.add_argument("--slots", type=int, default=0,
                    help="KV cache slots (a served engine's max_sessions; 0: the batch's own), the rows in the first")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    model, cfg, dev, dtype = profiled_model(args.tiny)
    summary = []
    programs = [int(p) for p in args.keys_per_split.split(",") if p] or [flex.KEYS_PER_SPLIT]
    batches = [int(x) for x in args.batches.split(",")]
    if args.slots and args.slots < max(batches):
        ap.error(f"--slots {args.slots} holds no batch of {max(batches)}")
    for b in batches:
        for name in args.sdpa.split(","):
            for keys in programs:
                model.flex_prefill_keys_per_split = keys
                try:
                    with sdpa_kernel(SDPA_SETS[name]) if name != "default" else contextlib.nullcontext():
                        summary.append((name, keys, b, *profile_one(model, cfg, b, args, dev, dtype)))
                except RuntimeError as exc:  # e.g. no kernel of the set takes this mask on this device
                    print(f"\n== batch {b}, sdpa {name}: {exc} ==")
    print("\nsdpa | flex keys per split | batch | slots | eager wall ms | GPU ms | attention ms | split partials MB "
          "per layer | flex reduction ms | KV gather ms")
    for name, keys, b, wall, gpu, attn, partials, reduction, gather in summary:
        mb = "-" if partials is None else f"{partials / 1e6:.1f}"
        print(f"{name} | {keys if args.flex else '-'} | {b} | {args.slots or b} | {wall:.1f} | {gpu:.1f} | "
              f"{attn:.1f} | {mb} | {reduction:.1f} | {gather:.1f}")


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
                dtype: torch.dtype) -> tuple[float, float, float, int | None, float, float]:
    """(wall ms of the eager forward, its GPU ms, of which attention, the flex split's partials in bytes per layer
    (None: no flex decoding kernel), the flex call's reduction ms and the KV gather ms) for b rows."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if dev.type == "cuda" else [])
    kv = random_kv(cfg, args.slots or b, args.context + 64, dev, dtype)
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
    # the eager forward's own kernels are aten's: the other Triton kernels are the compiled flex call's reduction
    reduction = sum(v for k, v in ops.items() if k.startswith("triton_") and not k.startswith("triton_tem"))
    return wall, _total_ms(table), attention, split_partials(model, cfg, kv, n, dev), reduction, \
        ops.get("aten::index", 0.0)


def split_partials(model: Qwen3LLM, cfg: LLMConfig, kv: SlotKVCache, positions: int, dev: torch.device) -> int | None:
    """Bytes per layer of the flex decoding kernel's partial results for rows of `positions` (its batch: every
    cache slot), None where that kernel does not run (off CUDA, longer rows)."""
    if dev.type != "cuda" or positions > flex.FLEX_DECODING_MAX_POSITIONS:
        return None
    slots = kv.slots + 1
    splits = flex.decode_splits(kv.max_len, dev, model.flex_prefill_keys_per_split)
    if splits is None:  # torch's count (torch/_inductor/kernel/flex/flex_decoding.py get_split_k)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = max(1, 2 * sms // (slots * cfg.num_key_value_heads))
    return flex.split_partials_bytes(slots, splits, cfg.num_attention_heads, positions, cfg.head_dim)


def _total_ms(table: str) -> float:
    """The profiler's own GPU (else CPU) total, as its table prints it."""
    m = re.search(r"Self CUDA time total: ([\d.]+)(us|ms|s)\b", table) or re.search(
        r"Self CPU time total: ([\d.]+)(us|ms|s)\b", table)
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)] if m else float("nan")

if __name__ == "__main__":
    main()
