"""Stage0 LLM benchmark (targets.md P1-P3): decode step and unit prefill, ours vs HF transformers vs floor.

Full size (model.md §1.2, dummy weights N(0, 0.02), §9.5) on a GPU:
    python bench/bench_stage0.py --batches 1,8,32,64 --context 2048 --prefill-context 4096 --json out.json
CPU smoke test on the tiny model:
    python bench/bench_stage0.py --tiny
Prints a table last: median and p99 ms per step, beside the bandwidth floor and HF in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from engine.config import LLMConfig
from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0.graphs import DecodeGraphs
from engine.stage0.runner import KV_LIMIT_QUANTUM

FULL = LLMConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=151748, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6)
TINY = LLMConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6)
UNIT_PREFILL = 11  # `<unit>` + 10 audio embeddings
WEIGHT_STD = 0.02  # model.md §9.4 / §9.5


def dummy_init(model: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, WEIGHT_STD)


def timed(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """Median and p99 wall ms of fn(), synchronising around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def floor_ms(cfg: LLMConfig, n_params: int, elem: int, kv_positions: int, bw: float) -> float:
    kv_bytes = kv_positions * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
    return (n_params * elem + kv_bytes) / bw * 1e3


def bench_decode(model: Qwen3LLM, cfg: LLMConfig, b: int, args: argparse.Namespace, dev: torch.device,
                 dtype: torch.dtype) -> list[dict]:
    kv = SlotKVCache.allocate(cfg, b, args.context + args.extra, dtype=dtype, device=dev)
    for t in (*kv.k, *kv.v):
        t.normal_()
    x = torch.randn(b, 1, cfg.hidden_size, dtype=dtype, device=dev)
    pos = torch.full((b, 1), args.context, device=dev)
    slots = torch.arange(b)  # dense layout, as the engine's decode rows: row i = slot i
    span = -(-(args.context + 1) // KV_LIMIT_QUANTUM) * KV_LIMIT_QUANTUM
    out = []
    with torch.no_grad():
        eager = timed(lambda: model.logits(model(x, pos, None, kv, kv_limit=span)[:, -1]),
                      args.iters, args.warmup, dev)
        out.append(dict(name="ours eager decode", batch=b, ctx=args.context, ms=eager))
        modes = [None] + ([args.compile] if args.compile else [])
        pos_host = pos[:, 0].cpu()
        for mode in modes:
            graphs = DecodeGraphs.create(model, kv, (b,), (span,), enabled=not args.no_graphs, compile_mode=mode)
            if graphs is None:
                continue
            ms = timed(lambda g=graphs: model.logits(g.run(x[:, 0], pos_host, slots, args.context + 1)),
                       args.iters, args.warmup, dev)
            name = "ours graph decode" + (" +compile" if mode else "")
            out.append(dict(name=name, batch=b, ctx=args.context, ms=ms))
    return out


def bench_ours(model: Qwen3LLM, cfg: LLMConfig, args: argparse.Namespace, dev: torch.device,
               dtype: torch.dtype) -> list[dict]:
    out = [row for b in args.batches for row in bench_decode(model, cfg, b, args, dev, dtype)]
    kv = SlotKVCache.allocate(cfg, 1, args.prefill_context + args.extra, dtype=dtype, device=dev)
    x = torch.randn(1, UNIT_PREFILL, cfg.hidden_size, dtype=dtype, device=dev)
    pos = torch.arange(args.prefill_context, args.prefill_context + UNIT_PREFILL, device=dev)[None]
    with torch.no_grad():
        ms = timed(lambda: model.logits(model(x, pos, torch.zeros(1, dtype=torch.long, device=dev), kv)[:, -1]),
                   args.iters, args.warmup, dev)
    out.append(dict(name="ours unit prefill", batch=1, ctx=args.prefill_context, ms=ms))
    return out


def bench_hf(cfg: LLMConfig, state: dict, args: argparse.Namespace, dev: torch.device,
             dtype: torch.dtype) -> list[dict]:
    import transformers

    hf_cfg = transformers.Qwen3Config(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the run dtype: no fp32 copy of 8 B parameters
    try:
        with torch.device(dev):
            ref = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ref.load_state_dict(state, strict=False)
    out = []

    def prefilled(b: int, ctx: int) -> transformers.DynamicCache:
        cache = transformers.DynamicCache(config=hf_cfg)
        for i in range(b):  # one row at a time keeps the prefill's activations small
            c = transformers.DynamicCache(config=hf_cfg)
            ref.model(inputs_embeds=torch.randn(1, ctx, cfg.hidden_size, dtype=dtype, device=dev),
                      past_key_values=c, use_cache=True)
            for layer in range(cfg.num_hidden_layers):
                k, v = c.layers[layer].keys, c.layers[layer].values
                if i == 0:
                    cache.update(k, v, layer)
                else:
                    lay = cache.layers[layer]
                    lay.keys, lay.values = torch.cat([lay.keys, k]), torch.cat([lay.values, v])
        return cache

    with torch.no_grad():
        for b in args.hf_batches:
            cache = prefilled(b, args.context)
            x = torch.randn(b, 1, cfg.hidden_size, dtype=dtype, device=dev)

            def step(x: torch.Tensor = x, cache: transformers.DynamicCache = cache) -> None:
                h = ref.model(inputs_embeds=x, past_key_values=cache, use_cache=True).last_hidden_state
                ref.lm_head(h[:, -1])
                cache.crop(-1)  # drop the timed position again

            out.append(dict(name="HF eager decode", batch=b, ctx=args.context,
                            ms=timed(step, args.hf_iters, 2, dev)))
            del cache
        cache = prefilled(1, args.prefill_context)
        x = torch.randn(1, UNIT_PREFILL, cfg.hidden_size, dtype=dtype, device=dev)

        def unit() -> None:
            h = ref.model(inputs_embeds=x, past_key_values=cache, use_cache=True).last_hidden_state
            ref.lm_head(h[:, -1])
            cache.crop(-UNIT_PREFILL)

        out.append(dict(name="HF eager unit prefill", batch=1, ctx=args.prefill_context,
                        ms=timed(unit, args.hf_iters, 2, dev)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--hf-batches", default="1,8")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefill-context", type=int, default=4096)
    ap.add_argument("--extra", type=int, default=64, help="KV positions beyond the context")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--hf-iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="device bytes/s (H200 measured)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--compile", default=None, help="also time a torch.compile'd graph (e.g. max-autotune-no-cudagraphs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.context, args.prefill_context, args.iters, args.hf_iters = 64, 128, 5, 3
        args.batches, args.hf_batches = "1,8", "1"
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = TINY if args.tiny else FULL
    with torch.device(dev):
        model = Qwen3LLM(cfg).to(dtype).eval()
    dummy_init(model)
    n_params = sum(p.numel() for p in model.parameters())
    elem = torch.finfo(dtype).bits // 8
    rows = bench_ours(model, cfg, args, dev, dtype)
    if not args.no_hf:
        rows += bench_hf(cfg, model.state_dict(), args, dev, dtype)
    for r in rows:
        positions = r["batch"] * r["ctx"]
        r["floor_ms"] = floor_ms(cfg, n_params, elem, positions, args.bandwidth)
        r["median_ms"], r["p99_ms"] = r.pop("ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
                           params=n_params, rows=rows), f, indent=2)
    print(f"{'what':28s} {'batch':>5s} {'ctx':>6s} {'median ms':>10s} {'p99 ms':>8s} {'floor ms':>9s} {'x floor':>8s}")
    for r in rows:
        print(f"{r['name']:28s} {r['batch']:5d} {r['ctx']:6d} {r['median_ms']:10.3f} {r['p99_ms']:8.3f} "
              f"{r['floor_ms']:9.3f} {r['median_ms'] / r['floor_ms']:8.2f}")


if __name__ == "__main__":
    main()
