"""What the LLM's 128-row GEMM tiles cost, and which single GEMMs would give the same bits (issue 16).

`gemm_tile_rows: 128` (the h200 profiles) runs every stage0 GEMM of more than 128 rows as one cuBLAS call per
128 rows, so a row's numbers come from one kernel whatever shares its step (batch invariance); each call reads
the whole weight again: 4 reads for a 32-unit prefill (416 rows). The H100 timed the 32-unit engine step at 37.7 ms
with the tiles and 31.1 ms without (bench/RESULTS.md stop 50). Per weight of the full-size LLM and per row count
M, this prints the tiled and the single GEMM's median time and whether the single GEMM over M rows (the rows
padded to M) gives bit for bit the tiles' result: where it does on a device, one GEMM could replace the tiles
there without giving up the invariance.

    python bench/bench_gemm_tiles.py [--rows 128,256,384,512,640,1024] [--tile 128] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_stage0 import timed  # noqa: E402
from engine.model.layers import gemm_tiles  # noqa: E402

# (name, out_features, in_features) of the full-size Qwen3-8B GEMMs as the engine runs them (fused projections,
# the lm_head padded to a multiple of 64 rows: engine/model/llm.py)
WEIGHTS = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
           ("lm_head", 151808, 4096))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,256,384,512,640,1024", help="GEMM row counts (multiples of --tile)")
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    rows = [int(r) for r in args.rows.split(",") if r]
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "tile": args.tile, "rows": []}
    print(f"{'weight':<8} {'M':>5} {'tiled ms':>9} {'single ms':>10} {'same bits':>9}")
    for name, n, k in WEIGHTS:
        w = (torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k ** -0.5).contiguous()
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            same = bool(torch.equal(gemm_tiles(x, w, args.tile), F.linear(x, w)))
            t_tiled, _ = timed(lambda x=x, w=w: gemm_tiles(x, w, args.tile), args.iters, 3, dev)
            t_single, _ = timed(lambda x=x, w=w: F.linear(x, w), args.iters, 3, dev)
            print(f"{name:<8} {m:>5} {t_tiled:>9.3f} {t_single:>10.3f} {'yes' if same else 'NO':>9}", flush=True)
            out["rows"].append({"weight": name, "m": m, "tiled_ms": round(t_tiled, 4), "single_ms": round(t_single, 4),
                                "same_bits": same})
        del w
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
