"""Where a shared pass's rows part from the split passes' (`mixed_step: shared` with `gemm_tile_rows`, issue 14).

One decoder layer at the real width, the engine's decode, prefill and shared graph sets over one KV (as
tests/engine/test_stage0_bf16_batch.py::test_bf16_full_width_shared_pass_rows_equal_split_with_gemm_tiles), and for
each mix of token rows and units the largest |difference| of the shared pass's token rows from the decode graph's
and of its unit rows from the prefill graph's. Variants, to find what a compiled graph changes (the eager graphs
agree bit for bit on an H100, the compiled ones did not):
  --opaque-gemm    every tiled GEMM through the custom op `duplex::tiled_linear`, also at or below the tile (inductor
                   then never lowers the GEMM itself)
  --emulate-casts  inductor rounds a fused kernel's intermediates to the model dtype as eager does
                   (`torch._inductor.config.emulate_precision_casts`)
On the GPU:  python bench/shared_pass_invariance.py --compile default --opaque-gemm
On the CPU (small width, eager replay, matmul/gather attention: inductor's CPU flex template does not build):
    python bench/shared_pass_invariance.py --small
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_stage0 import FULL, MERGED_PREFILL, dummy_init, random_kv
from engine.model import layers, llm
from engine.model.llm import Qwen3LLM
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, SharedGraphs

MIXES = ((1, 1), (3, 2), (8, 5), (16, 8))  # token rows (slots 0..n-1), units (slots 16..16+m-1)


def opaque_linear(x: torch.Tensor, weight: torch.Tensor, min_rows: int = 0, tile: bool = False,
                  bias: torch.Tensor | None = None, _plain=layers.linear) -> torch.Tensor:  # noqa: ANN001
    if tile and min_rows:
        return layers.tiled_linear(x, weight, bias, min_rows)
    return _plain(x, weight, min_rows, tile, bias)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", default=None, help="torch.compile mode of the graphs (served: default)")
    ap.add_argument("--tile", type=int, default=128, help="Stage0Config.gemm_tile_rows (0: off, 32 rows padded)")
    ap.add_argument("--opaque-gemm", action="store_true")
    ap.add_argument("--emulate-casts", action="store_true")
    ap.add_argument("--small", action="store_true", help="a 512-wide layer on the CPU")
    args = ap.parse_args()
    if args.opaque_gemm:
        layers.linear = llm.linear = opaque_linear
    if args.emulate_casts:
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    dev = torch.device("cpu" if args.small else "cuda")
    cfg = dataclasses.replace(FULL, num_hidden_layers=1)
    if args.small:
        cfg = dataclasses.replace(cfg, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                  num_key_value_heads=2, vocab_size=1000)
    ctx, slots, flex = 1024, 32, not args.small
    with torch.device(dev):
        model = Qwen3LLM(cfg).to(torch.bfloat16).eval()
    dummy_init(model)
    model.fuse_projections().pad_gemm_rows(args.tile or 32, tile=args.tile > 0)
    kv = random_kv(cfg, slots, ctx + 64, dev, torch.bfloat16)
    how = dict(compile_mode=args.compile, eager_replay=dev.type != "cuda")
    decode = DecodeGraphs.create(model, kv, (2, 4, 8, 16, 32), (ctx + 32,),
                                 decode_attention="flex" if flex else "matmul", **how)
    prefill = PrefillGraphs.create(model, kv, (2, 4, 8), (MERGED_PREFILL,), (ctx + 32,), flex=flex, **how)
    assert decode is not None and prefill is not None
    shared = SharedGraphs.create(decode, prefill, MERGED_PREFILL, 16, **how)
    assert shared is not None
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    units = [torch.randn(MERGED_PREFILL, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16) for _ in range(8)]
    print(f"compile {args.compile} tile {args.tile} opaque_gemm {args.opaque_gemm} emulate_casts "
          f"{args.emulate_casts} on {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}")
    print("token rows | units | max |diff| token rows | max |diff| unit rows")
    for n, m in MIXES:
        pos, token_slots, unit_slots = torch.full((n,), ctx), torch.arange(n), list(range(16, 16 + m))
        want_d = decode.run(x[:n], pos, token_slots, ctx + 1).clone()
        want_u = [h.clone() for h in prefill.run(unit_slots, [ctx] * m, units[:m])]
        got_u, got_d = shared.run(unit_slots, [ctx] * m, units[:m], x[:n], pos, token_slots)
        du = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got_u, want_u, strict=True))
        print(f"{n} | {m} | {float((got_d.float() - want_d.float()).abs().max()):.4g} | {du:.4g}")


if __name__ == "__main__":
    main()
