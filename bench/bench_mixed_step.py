"""A stage0 step that holds both decoded tokens and unit prefills, three ways (`Stage0Config.mixed_step`, issues 14
and 16): "split" (the decode graph, then the prefill graph: two passes over the weights), "merge" (the token rows
as one-position rows of the prefill graph) and "shared" (one pass, each kind attending as alone). Times each for
U sessions' units beside D sessions' tokens at one context, and says whether the token rows' hidden states
equal split's bit for bit (what keeps a session's ids independent of who prefills in its step).

Full size on a GPU (dummy weights, model.md §9.5), compiled graphs as served:
    python bench/bench_mixed_step.py --context 8192 --mixes 1:1,1:3,2:2,2:6,4:4 --compile default --json out.json
CPU smoke test (tiny model, graphs in eager replay):
    python bench/bench_mixed_step.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_stage0 import FULL, MERGED_PREFILL, TINY, dummy_init, fresh_compile, random_kv, timed
from engine.model.llm import Qwen3LLM
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, SharedGraphs

UNIT_BUCKETS = (2, 4, 8)  # Stage0Config.prefill_batch_buckets
DECODE_BUCKETS = (2, 4, 8, 16)  # Stage0Config.shared_decode_buckets


def build(model: Qwen3LLM, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype
          ) -> tuple[DecodeGraphs, PrefillGraphs, SharedGraphs]:
    """The three graph sets over one KV of 16 slots, each row `--context` positions deep; one span (the slot's)."""
    kv = random_kv(model.cfg, max(DECODE_BUCKETS), args.context + 64, dev, dtype)
    how = dict(compile_mode=args.compile, eager_replay=dev.type != "cuda")
    fresh_compile(args.compile)
    decode = DecodeGraphs.create(model, kv, DECODE_BUCKETS, (), **how)
    prefill = PrefillGraphs.create(model, kv, UNIT_BUCKETS, (MERGED_PREFILL,), (), flex=dev.type == "cuda", **how)
    shared = SharedGraphs.create(decode, prefill, MERGED_PREFILL, max(DECODE_BUCKETS), **how)
    assert decode is not None and prefill is not None and shared is not None
    return decode, prefill, shared


def bench_mix(graphs: tuple[DecodeGraphs, PrefillGraphs, SharedGraphs], units: int, tokens: int,
              args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    decode, prefill, shared = graphs
    h, ctx = decode.model.cfg.hidden_size, args.context
    gen = torch.Generator().manual_seed(units * 100 + tokens)
    x = torch.randn(tokens, h, generator=gen).to(dev, dtype)  # tokens at slots 0..D-1, units after them
    pos, token_slots = torch.full((tokens,), ctx), torch.arange(tokens)
    unit_slots = list(range(tokens, tokens + units))
    embeds = [torch.randn(MERGED_PREFILL, h, generator=gen).to(dev, dtype) for _ in range(units)]
    starts = [ctx] * units

    def split() -> torch.Tensor:
        out = decode.run(x, pos, token_slots, ctx + 1)
        prefill.run(unit_slots, starts, embeds)
        return out

    def merge() -> torch.Tensor:
        out = prefill.run(unit_slots + token_slots.tolist(), starts + pos.tolist(), embeds + list(x[:, None]))
        return torch.stack([o[0] for o in out[units:]])

    def one_pass() -> torch.Tensor:
        return shared.run(unit_slots, starts, embeds, x, pos, token_slots)[1]

    rows, want = [], None
    with torch.no_grad():
        for name, fn in (("split", split), ("merge", merge), ("shared", one_pass)):
            if name == "merge" and units + tokens > UNIT_BUCKETS[-1]:
                continue
            got = fn()
            want = got if want is None else want
            ms = timed(fn, args.iters, args.warmup, dev)
            rows.append(dict(what=f"mixed {name}", units=units, tokens=tokens, context=ctx, median_ms=ms[0],
                             p99_ms=ms[1], tokens_equal_split=bool(torch.equal(got, want)),
                             max_abs_diff=float((got.float() - want.float()).abs().max())))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--context", type=int, default=8192, help="retained KV positions of every row")
    ap.add_argument("--mixes", default="1:1,1:3,2:2,2:6,4:4", help="UNITS:TOKENS per step, comma separated")
    ap.add_argument("--compile", default=None, help="torch.compile mode of the graphs (served: default)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.context, args.iters, args.warmup = min(args.context, 128), 3, 1
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = Qwen3LLM(TINY if args.tiny else FULL).to(dtype).eval()
    dummy_init(model)
    model.fuse_projections()
    graphs = build(model, args, dev, dtype)
    rows = []
    for mix in args.mixes.split(","):
        units, tokens = (int(n) for n in mix.split(":"))
        rows += bench_mix(graphs, units, tokens, args, dev, dtype)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, dtype=str(dtype), compile=args.compile, rows=rows),
                                              indent=2) + "\n")
    print(f"{'what':14s} {'units':>5s} {'tokens':>6s} {'ctx':>6s} {'median ms':>10s} {'p99 ms':>8s} {'= split':>8s}")
    for r in rows:
        print(f"{r['what']:14s} {r['units']:5d} {r['tokens']:6d} {r['context']:6d} {r['median_ms']:10.3f} "
              f"{r['p99_ms']:8.3f} {str(r['tokens_equal_split']):>8s}")


if __name__ == "__main__":
    main()
