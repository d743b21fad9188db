"""Which op makes a session's numbers depend on its batch? (issue 16, full-size batch invariance)

bench_mixed_step's "alone vs among" rows showed that at full size a decode step's row 0 differs when other rows
share its step (stop 36), with the GEMMs padded (`gemm_min_rows`) too. This runs the pieces of one full-size
decoder layer (random weights, bf16, row 0's input the same at every row count n) one by one and says, per op and
n, whether row 0's output equals its output among 2 rows (the engine's smallest graph bucket), bit for bit:
  - each op alone, eager: the RMSNorms, the q/k/v GEMM, the decode attention's parts (matmul mode: QK^T, softmax,
    PV), SDPA, o_proj, the MLP GEMMs, unpadded and padded to --min-rows;
  - the whole one-layer forward as the engine runs it: decode (matmul, flex) and a unit prefill (flex, gathered),
    eager and with the layer compiled (`compile_layers`, as `compile_mode: default` serves).
Run on the GPU (host Python with torch):
    python bench/batch_invariance_ops.py --context 2048 --slots 64 --json out.json
CPU smoke test (tiny model, fp32): python bench/batch_invariance_ops.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_stage0 import FULL, MERGED_PREFILL, TINY, dummy_init, fresh_compile, random_kv  # noqa: E402
from engine.model.layers import compile_layers, linear  # noqa: E402
from engine.model.llm import Qwen3LLM  # noqa: E402


def counts(slots: int) -> list[int]:
    """The row counts compared: the engine's graph buckets (no 1: a lone row runs padded to 2)."""
    return [n for n in (2, 4, 8, 16, 32, 64) if n <= slots]


def compare(name: str, fn: Callable[[int], torch.Tensor], ns: list[int]) -> dict:
    """fn(n) -> row 0's output among n rows; equal / max |diff| against the first count (2) for every n."""
    alone = fn(ns[0]).clone()
    cells = {}
    for n in ns[1:]:
        got = fn(n)
        diff = float((got.float() - alone.float()).abs().max())
        cells[str(n)] = "=" if torch.equal(got, alone) else f"{diff:.2g}"
    return dict(op=name, cells=cells)


def op_rows(model: Qwen3LLM, kv, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """Each op of layer 0 alone, eager, row 0's input fixed."""
    cfg, layer = model.cfg, model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    h, d, kvh, heads = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    g, ns, ctx = heads // kvh, counts(args.slots), args.context
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(args.slots, 1, h, generator=gen).to(dev, dtype)
    mid = torch.randn(args.slots, 1, cfg.intermediate_size, generator=gen).to(dev, dtype)
    ao = torch.randn(args.slots, 1, heads * d, generator=gen).to(dev, dtype)
    q = torch.randn(args.slots, kvh, g, d, generator=gen).to(dev, dtype)
    keys, values = kv.k[0][:args.slots, :, :ctx + 1], kv.v[0][:args.slots, :, :ctx + 1]  # [S, kvh, L, D]
    mask = torch.zeros(args.slots, 1, g, ctx + 1, device=dev)
    scores = torch.matmul(q * d ** -0.5, keys.transpose(-1, -2)).float() + mask
    probs = torch.softmax(scores, dim=-1).to(dtype)
    rows = []
    with torch.no_grad():
        for pad in sorted({0, args.min_rows, *args.pads}):
            tag = f" (rows >= {pad})" if pad else ""
            weight = attn.qkv_weight if attn.qkv_weight is not None else attn.q_proj.weight
            rows.append(compare(f"qkv GEMM{tag}", lambda n, w=weight, p=pad: linear(x[:n], w, p)[0], ns))
            rows.append(compare(f"o_proj GEMM{tag}", lambda n, p=pad: linear(ao[:n], attn.o_proj.weight, p)[0], ns))
            up = mlp.gate_up_weight if mlp.gate_up_weight is not None else mlp.gate_proj.weight
            rows.append(compare(f"gate/up GEMM{tag}", lambda n, w=up, p=pad: linear(x[:n], w, p)[0], ns))
            rows.append(compare(f"down GEMM{tag}", lambda n, p=pad: linear(mid[:n], mlp.down_proj.weight, p)[0], ns))
        rows.append(compare("input RMSNorm", lambda n: layer.input_layernorm(x[:n])[0], ns))
        rows.append(compare("q RMSNorm (per head)", lambda n: attn.q_norm(q[:n])[0], ns))
        rows.append(compare("SiLU(gate) * up", lambda n: (F.silu(mid[:n]) * mid[:n])[0], ns))
        rows.append(compare("attention QK^T (bmm)", lambda n: torch.matmul(q[:n] * d ** -0.5,
                                                                           keys[:n].transpose(-1, -2))[0], ns))
        rows.append(compare("attention softmax (fp32)", lambda n: torch.softmax(scores[:n], dim=-1)[0], ns))
        rows.append(compare("attention PV (bmm)", lambda n: torch.matmul(probs[:n], values[:n])[0], ns))
        rows.append(compare("attention matmul (whole)", lambda n: attn.attend(
            q[:n].reshape(n, heads, 1, d), keys[:n], values[:n], mask[:n], "matmul")[0], ns))
        rows.append(compare("attention SDPA (folded)", lambda n: F.scaled_dot_product_attention(
            q[:n], keys[:n], values[:n])[0], ns))
    return rows


def forward_rows(model: Qwen3LLM, kv, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype,
                 compiled: bool) -> list[dict]:
    """The one-layer forward as the engine calls it: decode rows (dense layout), unit prefill rows (gathered)."""
    h, ctx, ns = model.cfg.hidden_size, args.context, counts(args.slots)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(args.slots, 1, h, generator=gen).to(dev, dtype)
    units = torch.randn(8, MERGED_PREFILL, h, generator=gen).to(dev, dtype)
    tag = " compiled" if compiled else " eager"
    fresh_compile("default" if compiled else None)
    layer_fn = compile_layers() if compiled else None
    if compiled:  # room for every row count's compile, as the engine's graph sets make (graphs._recompile_room)
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    rows = []
    with torch.no_grad():
        for how in ("matmul", "flex") if dev.type == "cuda" else ("matmul",):
            def decode(n: int, how: str = how) -> torch.Tensor:
                pos = torch.full((n, 1), ctx, device=dev)
                return model(x[:n], pos, None, kv, kv_limit=ctx + 1, layer_fn=layer_fn, decode_attention=how)[0, 0]
            rows.append(compare(f"decode forward [{how}]{tag}", decode, ns))

        def prefill(n: int) -> torch.Tensor:
            pos = ctx + torch.arange(MERGED_PREFILL, device=dev)[None].expand(n, -1)
            out = model(units[:n], pos, torch.arange(n, device=dev), kv, kv_limit=ctx + MERGED_PREFILL,
                        layer_fn=layer_fn, flex=dev.type == "cuda")
            return out[0]
        rows.append(compare(f"unit prefill forward{tag}", prefill, [n for n in (2, 4, 8) if n <= args.slots]))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--context", type=int, default=2048, help="retained KV positions of every row")
    ap.add_argument("--slots", type=int, default=64, help="rows at most (row counts 1, 2, 4 .. up to it)")
    ap.add_argument("--min-rows", type=int, default=32, help="the padded GEMM rows (Stage0Config.gemm_min_rows)")
    ap.add_argument("--pads", type=lambda v: [int(p) for p in v.split(",") if p], default=[],
                    help="more GEMM row paddings for the op rows, comma separated (e.g. 64,128)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled forward rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.context, args.slots = min(args.context, 128), min(args.slots, 8)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    base = TINY if args.tiny else FULL
    cfg = type(base)(**{**base.__dict__, "num_hidden_layers": 1})  # every layer runs the same code
    with torch.device(dev):
        model = Qwen3LLM(cfg).to(dtype).eval()
    dummy_init(model)
    model.fuse_projections()
    kv = random_kv(cfg, args.slots, args.context + 64, dev, dtype)
    rows = op_rows(model, kv, args, dev, dtype)
    model.pad_gemm_rows(args.min_rows)  # the forward as served (gemm_min_rows)
    rows += forward_rows(model, kv, args, dev, dtype, compiled=False)
    if not args.no_compile:
        rows += forward_rows(model, kv, args, dev, dtype, compiled=True)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    ns = [str(n) for n in counts(args.slots)[1:]]
    print(f"row 0 among n rows vs among 2 ({device}, {dtype}, context {args.context}, forward GEMMs >= "
          f"{args.min_rows} rows): '=' bit-equal, else max |diff|")
    print(f"{'op':42s} " + " ".join(f"{n:>7s}" for n in ns))
    for r in rows:
        print(f"{r['op']:42s} " + " ".join(f"{r['cells'].get(n, '-'):>7s}" for n in ns))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, dtype=str(dtype), context=args.context,
                                                   min_rows=args.min_rows, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
