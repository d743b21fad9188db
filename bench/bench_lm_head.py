"""The lm_head GEMM at the real size (issue 16): [rows, 4096] x [151748, 4096]^T against the same weight padded with
zero rows to an aligned count, and whether the first 151,748 logits keep their bits (`Qwen3LLM.fuse_projections`
pads to a multiple of `LM_HEAD_ALIGN`).

    python bench/bench_lm_head.py [--rows 1,2,32,128] [--pads 151808,152064]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

VOCAB, HIDDEN = 151748, 4096


def timed_ms(fn, iters: int = 50, warmup: int = 5) -> float:  # noqa: ANN001 - any callable
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


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
            ms = timed_ms(lambda x=x, wp=wp: F.linear(x, wp))
            same = torch.equal(F.linear(x, wp)[:, :VOCAB], F.linear(x, w))
            print(f"lm_head {vp} rows x {m}: {ms:.3f} ms, logits bit-equal to {VOCAB} rows: {same}", flush=True)


if __name__ == "__main__":
    main()
