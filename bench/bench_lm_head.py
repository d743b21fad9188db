"""The lm_head GEMM at the real size (issue 16): [rows, 4096] x [151748, 4096]^T against the same weight padded with
zero rows to an aligned count, and whether the first 151,748 logits keep their bits (`Qwen3LLM.fuse_projections`
pads to a multiple of `LM_HEAD_ALIGN`).

    python bench/bench_lm_head.py [--rows 1,2,32,128] [--pads 151808,152064]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_stage0 import timed  # noqa: E402

VOCAB, HIDDEN = 151748, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,32,128")
    ap.add_argument("--pads", default="151808,152064", help="padded row counts to compare")
    args = ap.parse_args()
    torch.manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.02
    for vp in [VOCAB, *(int(p) for p in args.pads.split(","))]:
        wp = torch.cat([w, w.new_zeros(vp - VOCAB, HIDDEN)])
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
            median, p99 = timed(lambda x=x, wp=wp: F.linear(x, wp), 50, 5, w.device)
            same = torch.equal(F.linear(x, wp)[:, :VOCAB], F.linear(x, w))
            print(f"lm_head {vp} rows x {m}: {median:.3f} / {p99:.3f} ms median / p99, logits bit-equal to {VOCAB} "
                  f"rows: {same}", flush=True)


if __name__ == "__main__":
    main()
