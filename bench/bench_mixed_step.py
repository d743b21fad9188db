"""A stage0 step that holds both decoded tokens and unit prefills, three ways (`Stage0Config.mixed_step`, issues 14
and 16): "split" (the decode graph, then the prefill graph: two passes over the weights), "merge" (the token rows
as one-position rows of the prefill graph) and "shared" (one pass, each kind attending as alone). Times each for
U sessions' units beside D sessions' tokens at one context, and says whether the token rows' hidden states
equal split's bit for bit (what keeps a session's ids independent of who prefills in its step).

Full size on a GPU (dummy weights, model.md §9.5), compiled graphs as served:
    python bench/bench_mixed_step.py --context 8192 --mixes 1:1,1:3,2:2,2:6,4:4 --compile default --json out.json
With `--tile-rows 128` (the h200 profiles' `gemm_tile_rows`) the shared rows equal split's bit for bit (stop 45).
CPU smoke test (tiny model, graphs in eager replay):
    python bench/bench_mixed_step.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_stage0 import FULL, MERGED_PREFILL, TINY, dummy_init, fresh_compile, random_kv, timed
from engine.model.llm import Qwen3LLM
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, SharedGraphs

UNIT_BUCKETS = (2, 4, 8)  # Stage0Config.prefill_batch_buckets
DECODE_BUCKETS = (2, 4, 8, 16)  # Stage0Config.shared_decode_buckets


def build(model: Qwen3LLM, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype
          ) -> tuple[DecodeGraphs, PrefillGraphs, SharedGraphs | None]:
    """The graph sets over one KV of `--slots` slots, each row `--context` positions deep (the shared set only
    with mixes to time)."""
    kv = random_kv(model.cfg, args.slots, args.context + 64, dev, dtype)
    how = dict(compile_mode=args.compile, eager_replay=dev.type != "cuda")
    model.verify_gemm_tiles(max(UNIT_BUCKETS) * MERGED_PREFILL + max(args.shared_buckets))  # as the engine does
    fresh_compile(args.compile)
    decode = DecodeGraphs.create(model, kv, decode_buckets(args), args.spans, decode_attention=args.decode_attention,
                                 **how)
    prefill = PrefillGraphs.create(model, kv, UNIT_BUCKETS, (MERGED_PREFILL,), args.spans, flex=dev.type == "cuda",
                                   **how)
    shared = SharedGraphs.create(decode, prefill, MERGED_PREFILL, max(args.shared_buckets), **how) if args.mixes else None
    assert decode is not None and prefill is not None
    return decode, prefill, shared


def decode_buckets(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(b for b in (2, 4, 8, 16, 32, 64) if b <= args.slots)


def mix_inputs(decode: DecodeGraphs, units: int, tokens: int, context: int, seed: int) -> tuple:
    """A mixed step's inputs: token rows at slots 0..D-1 (x, positions, slots), units after them (slots, starts,
    embeddings), all at `context`."""
    h, dev, dtype = decode.model.cfg.hidden_size, decode.device, decode.dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen).to(dev, dtype)
    embeds = [torch.randn(MERGED_PREFILL, h, generator=gen).to(dev, dtype) for _ in range(units)]
    return x, torch.full((tokens,), context), torch.arange(tokens), list(range(tokens, tokens + units)), \
        [context] * units, embeds


def shared_vs_split(graphs: tuple[DecodeGraphs, PrefillGraphs, SharedGraphs | None], units: int, tokens: int,
                    context: int) -> tuple[float, float]:
    """One shared pass beside the split passes on the same inputs (tokens at slots 0..D-1, units after them): the
    largest |difference| of its token rows from the decode graph's and of its unit rows from the prefill graph's
    (0, 0: bit-equal; tests/engine/test_stage0_bf16_batch.py asserts it with `Stage0Config.gemm_tile_rows`)."""
    decode, prefill, shared = graphs
    assert shared is not None
    x, pos, token_slots, unit_slots, starts, embeds = mix_inputs(decode, units, tokens, context, 7)
    with torch.no_grad():
        want_d = decode.run(x, pos, token_slots, context + 1).clone()
        want_u = [u.clone() for u in prefill.run(unit_slots, starts, embeds)]
        got_u, got_d = shared.run(unit_slots, starts, embeds, x, pos, token_slots)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max())
    return diff(got_d, want_d), max(diff(a, b) for a, b in zip(got_u, want_u, strict=True))


def bench_mix(graphs: tuple[DecodeGraphs, PrefillGraphs, SharedGraphs | None], units: int, tokens: int,
              args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    decode, prefill, shared = graphs
    assert shared is not None
    ctx = args.context
    x, pos, token_slots, unit_slots, starts, embeds = mix_inputs(decode, units, tokens, ctx, units * 100 + tokens)

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
        for name, fn in (("decode", lambda: decode.run(x, pos, token_slots, ctx + 1)),
                         ("prefill", lambda: prefill.run(unit_slots, starts, embeds))):  # the two halves of split
            ms = timed(fn, args.iters, args.warmup, dev)
            rows.append(dict(what=f"{name} only", units=units if name == "prefill" else 0,
                             tokens=tokens if name == "decode" else 0, context=ctx, median_ms=ms[0], p99_ms=ms[1],
                             tokens_equal_split=None, max_abs_diff=None))
        for name, fn in (("split", split), ("merge", merge), ("shared", one_pass)):
            if name == "merge" and units + tokens > UNIT_BUCKETS[-1]:
                continue
            got = fn()
            want = got if want is None else want
            ms = timed(fn, args.iters, args.warmup, dev)
            rows.append(dict(what=f"mixed {name}", units=units, tokens=tokens, context=ctx, median_ms=ms[0],
                             p99_ms=ms[1], tokens_equal_split=bool(torch.equal(got, want)),
                             max_abs_diff=float((got.float() - want.float()).abs().max())))
    rows[-1]["units_max_abs_diff"] = shared_vs_split(graphs, units, tokens, ctx)[1]  # the shared row's unit rows
    return rows


def invariance(graphs: tuple[DecodeGraphs, PrefillGraphs, SharedGraphs | None], args: argparse.Namespace,
               dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """Split's own batch invariance at this size: one session's token row (unit row, logits row) alone in its
    graph and beside others (a larger bucket), compared bit for bit, and the step's time. The engine's batched ==
    solo tests run a tiny model; at full size the GEMMs of another row count may pick other kernels."""
    decode, prefill, _ = graphs
    model, ctx = decode.model, args.context
    h = model.cfg.hidden_size
    gen = torch.Generator().manual_seed(7)
    rows = []

    def row(what: str, n: int, got: torch.Tensor, alone: torch.Tensor, fn: Callable[[], object]) -> None:
        ms = timed(fn, args.iters, args.warmup, dev)
        rows.append(dict(what=what, rows=n, context=ctx, median_ms=ms[0], p99_ms=ms[1],
                         equal_alone=bool(torch.equal(got, alone)),
                         max_abs_diff=float((got.float() - alone.float()).abs().max())))

    with torch.no_grad():
        x = torch.randn(args.slots, h, generator=gen).to(dev, dtype)
        buckets = decode_buckets(args)

        def step(n: int) -> torch.Tensor:
            return decode.run(x[:n], torch.full((n,), ctx), torch.arange(n), ctx + 1)

        alone = step(1)[0].clone()
        row("decode alone vs among", 1, alone, alone, lambda: step(1))
        for n in buckets[1:]:
            row("decode alone vs among", n, step(n)[0], alone, lambda n=n: step(n))
        hidden = torch.randn(max(buckets), h, generator=gen).to(dev, dtype)
        alone = model.logits(hidden[:1])[0].clone()
        for n in buckets:
            row("logits alone vs among", n, model.logits(hidden[:n])[0], alone, lambda n=n: model.logits(hidden[:n]))
        embeds = [torch.randn(MERGED_PREFILL, h, generator=gen).to(dev, dtype) for _ in range(UNIT_BUCKETS[-1])]
        alone = prefill.run([0], [ctx], embeds[:1])[0].clone()
        for n in UNIT_BUCKETS[1:]:
            got = prefill.run(list(range(n)), [ctx] * n, embeds[:n])[0]
            row("prefill alone vs among", n, got, alone, lambda n=n: prefill.run(list(range(n)), [ctx] * n, embeds[:n]))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--context", type=int, default=8192, help="retained KV positions of every row")
    ap.add_argument("--mixes", default="1:1,1:3,2:2,2:6,4:4", help="UNITS:TOKENS per step, comma separated")
    ap.add_argument("--compile", default=None, help="torch.compile mode of the graphs (served: default)")
    ap.add_argument("--spans", default="", help="attention span buckets of the graphs (the profile's "
                    "decode_kv_buckets), comma separated; the top span (the whole retained KV) is always there")
    ap.add_argument("--decode-attention", default=None, choices=("matmul", "sdpa", "flex"),
                    help="the token rows' attention (default: the model's, matmul)")
    ap.add_argument("--slots", type=int, default=16, help="KV slots (the decode buckets go up to it, at most 64)")
    ap.add_argument("--shared-buckets", default=",".join(map(str, DECODE_BUCKETS)),
                    help="the shared pass's token buckets (Stage0Config.shared_decode_buckets; the h200 profiles' "
                         "go to 32 or 64)")
    ap.add_argument("--min-rows", type=int, default=0, help="least GEMM rows (Stage0Config.gemm_min_rows; 0: off)")
    ap.add_argument("--tile-rows", type=int, default=0,
                    help="every GEMM on exactly this many rows (Stage0Config.gemm_tile_rows; 0: off, --min-rows rules)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.spans = tuple(int(v) for v in args.spans.split(",") if v)
    args.shared_buckets = tuple(int(v) for v in args.shared_buckets.split(",") if v)
    if args.tiny:
        args.context, args.iters, args.warmup = min(args.context, 128), 3, 1
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = Qwen3LLM(TINY if args.tiny else FULL).to(dtype).eval()
    dummy_init(model)
    model.fuse_projections()
    model.pad_gemm_rows(args.tile_rows or args.min_rows, tile=args.tile_rows > 0)
    graphs = build(model, args, dev, dtype)
    rows = []
    for mix in filter(None, args.mixes.split(",")):
        units, tokens = (int(n) for n in mix.split(":"))
        rows += bench_mix(graphs, units, tokens, args, dev, dtype)
    rows += invariance(graphs, args, dev, dtype)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, dtype=str(dtype), compile=args.compile,
                                                   min_rows=args.min_rows, tile_rows=args.tile_rows, rows=rows),
                                              indent=2) + "\n")
    print(f"{'what':22s} {'units':>5s} {'tokens':>6s} {'ctx':>6s} {'median ms':>10s} {'p99 ms':>8s} {'= split':>8s}")
    for r in rows:
        if "equal_alone" in r:
            print(f"{r['what']:22s} {r['rows']:12d} {r['context']:6d} {r['median_ms']:10.3f} {r['p99_ms']:8.3f} "
                  f"{str(r['equal_alone']):>8s} (= alone; max |diff| {r['max_abs_diff']:.3g})")
        else:
            print(f"{r['what']:22s} {r['units']:5d} {r['tokens']:6d} {r['context']:6d} {r['median_ms']:10.3f} "
                  f"{r['p99_ms']:8.3f} {str(r['tokens_equal_split']):>8s}"
                  + (f" (unit rows max |diff| {r['units_max_abs_diff']:.3g})" if "units_max_abs_diff" in r else ""))


if __name__ == "__main__":
    main()
