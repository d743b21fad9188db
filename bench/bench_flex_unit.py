"""The unit prefill's attention kernel alone, over Triton configurations (issue 16).

    python bench/bench_flex_unit.py --rows 1,8,32 --slots 32 --context 8192 --configs default,w4s1,w4s2,n32w4s2

A unit prefill attends `--positions` query positions per row (13: the merged close, `<unit>` and 10 audio
embeddings) over its slot's KV straight from the cache (engine/model/flex.py `flex_slot_attend`, the flex decoding
kernel with the engine's split length). torch's default configuration for that kernel on sm_90 is BLOCK_N 64, one
stage, two warps (torch/_inductor/template_heuristics/triton.py `get_flex_decode_configs`), tuned for one query per
head: a unit packs 4 heads x 13 positions = 52 query rows per KV head into each tile. A configuration name is
`[nBLOCK_N][wWARPS][sSTAGES]` (any part left out keeps torch's) or `default`. Per row count and configuration:
the kernel's median and p99 over CUDA events, the KV bytes it must read at least (the rows' own context), and the
largest difference from `default`'s output (0 where the configuration keeps the sum order). Results as JSON with
`--results`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_stage0 import stats  # noqa: E402
from engine.model import flex  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B


def kernel_options(name: str, split_kv: int | None) -> dict[str, int]:
    """`default` or `[nN][wW][sS]` → the flex call's kernel_options (SPLIT_KV as the engine passes it)."""
    if name == "default":
        return flex.decoding_options(split_kv)
    m = re.fullmatch(r"(?:n(\d+))?(?:w(\d+))?(?:s(\d+))?", name)
    if not m or not any(m.groups()):
        raise ValueError(f"bad configuration {name!r}: default or [nBLOCK_N][wWARPS][sSTAGES]")
    tuning = tuple((key, int(value)) for key, value in zip(("BLOCK_N", "num_warps", "num_stages"), m.groups(),
                                                           strict=True) if value)
    return flex.decoding_options(split_kv, tuning)  # as the engine merges them (flex_slot_attend)


def time_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: flex.SlotBlocks,
                options: dict[str, int], iters: int) -> tuple[list[float], torch.Tensor]:
    def call() -> torch.Tensor:
        return flex.compiled_flex_attention(q, k, v, block_mask=blocks.block_mask, enable_gqa=True,
                                            kernel_options=options)

    out = call()
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32", help="live unit rows (slots 0..rows-1)")
    ap.add_argument("--slots", type=int, default=32, help="session slots of the cache (+1 scratch), as served")
    ap.add_argument("--context", type=int, default=8192, help="retained positions of each row before the unit")
    ap.add_argument("--positions", type=int, default=13)
    ap.add_argument("--keys-per-split", type=int, default=2048, help="the h200 profile's flex_prefill_keys_per_split")
    ap.add_argument("--configs", default="default,w4s1,w4s2,w4s3,n32w4s2,n128w4s2,w8s2")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--results", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    max_len = args.context + 64
    cache_rows = args.slots + 1
    k = torch.randn(cache_rows, KV_HEADS, max_len, HEAD_DIM, device=dev, dtype=dt)
    v = torch.randn_like(k)
    split_kv = flex.decode_splits(max_len, dev, args.keys_per_split)
    results = []
    print("rows | config | median ms | p99 ms | KV floor GB | max |diff| vs default")
    for rows in [int(r) for r in args.rows.split(",") if r]:
        t = args.positions
        pos = (args.context + torch.arange(t, device=dev))[None].expand(rows, t).contiguous()
        blocks = flex.slot_blocks(pos, torch.ones_like(pos, dtype=torch.bool), torch.arange(rows, device=dev),
                                  cache_rows, max_len, args.keys_per_split)
        q = torch.zeros(cache_rows, HEADS, t, HEAD_DIM, device=dev, dtype=dt)
        q[:rows] = torch.randn(rows, HEADS, t, HEAD_DIM, device=dev, dtype=dt)
        kv_gb = rows * KV_HEADS * (args.context + t) * HEAD_DIM * 2 * 2 / 1e9
        ref = None
        for name in args.configs.split(","):
            try:
                times, out = time_config(q, k, v, blocks, kernel_options(name, split_kv), args.iters)
            except Exception as exc:  # noqa: BLE001 - a configuration the kernel rejects is a result
                print(f"{rows} | {name} | failed: {type(exc).__name__}: {str(exc)[:160]}")
                results.append({"rows": rows, "config": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            out = out[:rows].float()
            if ref is None:
                ref = out
            diff = float((out - ref).abs().max())
            med, p99 = stats(times)
            print(f"{rows} | {name} | {med:.3f} | {p99:.3f} | {kv_gb:.3f} | {diff:.3g}")
            results.append({"rows": rows, "config": name, "median_ms": round(med, 4), "p99_ms": round(p99, 4),
                            "kv_floor_gb": round(kv_gb, 4), "max_abs_diff": diff})
    if args.results:
        Path(args.results).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "slots": args.slots, "context": args.context,
                                                  "positions": args.positions,
                                                  "keys_per_split": args.keys_per_split, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
