"""P4 benchmark: TTS, 25 codes for one speaking unit at batch 1 / 8 / 32 (targets.md).

Full-size TTS shapes (model.md §1.5) with random bf16 weights (§9.5 recipe). For each batch it times, in
one process, side by side:
  engine-eager  `TTSEngine.step()` (ragged prefill + 25 single-code steps + sampling, one host sync)
  engine-graph  the same with the single-code step replayed from a CUDA graph
  hf-ref        reference style: transformers LlamaModel + DynamicCache, per-step sampling with a host
                check for EOS, as `MiniCPMTTS.generate_chunk` does
Every unit is a mid-turn unit (EOS masked, exactly 25 codes) with `--rows` text rows. Times are CUDA
events around the whole unit (codes on the host), median / p99 over `--iters`. The floor is the bf16
weight bytes read per forward × 26 forwards / `--bandwidth`. Prints a table last and writes JSON.

    python bench/bench_tts.py                 # H200, full size
    python bench/bench_tts.py --tiny          # CPU smoke run (tiny dims, host clocks)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import TTSConfig  # noqa: E402
from engine.model.tts import TTSModel  # noqa: E402
from engine.stage1.config import TTSEngineConfig  # noqa: E402
from engine.stage1.tts_engine import TTSEngine  # noqa: E402
from engine.stage1.types import Fence, TTSUnitRequest  # noqa: E402
from engine.weights import init_module_  # noqa: E402

FULL = dict(llm_dim=4096, hidden_size=768, intermediate_size=3072, num_hidden_layers=20,
            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096,
            num_audio_tokens=6562, num_text_tokens=152064)
TINY = dict(llm_dim=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
            num_audio_tokens=6562, num_text_tokens=320)
FENCE = Fence(incarnation=0, epoch=0)
MID_TURN_POS = 64  # every timed unit starts here: mid-turn, so EOS is masked and 25 codes come out


def make_cfg(tiny: bool) -> TTSConfig:
    dims = TINY if tiny else FULL
    # a dummy id: benchmarks never decode text, any in-range row of emb_text will do
    return TTSConfig(**dims, audio_bos_token_id=dims["num_text_tokens"] - 1)


def make_model(cfg: TTSConfig, device: str, dtype: torch.dtype) -> TTSModel:
    with torch.device(device):
        model = TTSModel(cfg)
    init_module_(model, torch.Generator(device=device).manual_seed(0))
    model = model.to(dtype).eval()
    model.reset_rope_()
    return model


class Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
        return out


def requests(cfg: TTSConfig, batch: int, rows: int, device: str) -> list[TTSUnitRequest]:
    g = torch.Generator().manual_seed(batch)
    reqs = []
    for b in range(batch):
        ids = tuple(int(x) for x in torch.randint(0, cfg.num_text_tokens, (rows,), generator=g))
        hidden = torch.randn(rows, cfg.llm_dim, generator=g).to(device=device, dtype=torch.bfloat16)
        reqs.append(TTSUnitRequest(f"s{b}", FENCE, 0, ids, hidden, (False,) * rows, False, False))
    return reqs


def engine_unit(engine: TTSEngine, reqs: list[TTSUnitRequest], use_graphs: bool) -> Callable[[], object]:
    def run() -> object:
        for r in reqs:
            engine.sessions[r.session_id].tts_pos = MID_TURN_POS  # rewind: same positions each time
            engine.submit(r)
        results = engine.step(use_graphs=use_graphs)
        assert len(results) == len(reqs) and all(len(x.codes) == 25 for x in results)
        return results
    return run


def replays(engine: TTSEngine, batch: int) -> Callable[[], object]:
    """The 25 single-code step replays of a unit alone (no prefill, copy-in or host sync)."""
    bucket = engine.cfg.batch_bucket(batch)
    graph = next(g for k, g in engine.runner._graphs.items() if k[:2] == ("step", bucket))
    state = engine.runner._states[bucket]

    @torch.inference_mode()
    def run() -> None:
        state.t.fill_(1)  # the step counter indexes the samples buffer: restart it
        for _ in range(engine.cfg.max_new_tokens - 1):
            graph.graph.replay()
    return run


def hf_unit(model: TTSModel, reqs: list[TTSUnitRequest], device: str) -> Callable[[], object]:
    """Reference style: HF LlamaModel + DynamicCache; sampling in torch with a host EOS check per step."""
    from transformers import DynamicCache, LlamaConfig, LlamaModel

    c = model.cfg
    hf_cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                         max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                         vocab_size=8)
    dtype = model.emb_text.weight.dtype
    with torch.device(device):
        hf = LlamaModel(hf_cfg).to(dtype).eval()
    hf.load_state_dict({k[6:]: v for k, v in model.state_dict().items() if k.startswith("model.")},
                       strict=False)
    with torch.no_grad():
        cond = torch.stack([torch.cat([model.condition(torch.tensor(r.text_ids, device=device), r.hidden),
                                       model.audio_bos_row()[None]]) for r in reqs])  # [B, n+1, H]
    eos, b = c.eos_code, len(reqs)

    @torch.no_grad()
    def run() -> object:
        cache = DynamicCache()
        h = hf(inputs_embeds=cond, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        codes = torch.empty(b, 0, dtype=torch.int64, device=device)
        for t in range(26):
            scores = model.logits(h) / 0.8
            if t:
                freq = torch.nn.functional.one_hot(codes[:, -16:], scores.shape[1]).sum(1)
                alpha = torch.pow(1.05, freq)
                scores = torch.where(scores < 0, scores * alpha, scores / alpha)
            scores[:, eos] = float("-inf")
            nxt = torch.multinomial(torch.softmax(scores, -1), 1)  # [B, 1]
            if bool((nxt == eos).all()):  # the reference's per-step finish check (host sync)
                break
            codes = torch.cat([codes, nxt], 1)
            if t < 25:
                h = hf(inputs_embeds=model.embed_codes(nxt), past_key_values=cache,
                       use_cache=True).last_hidden_state[:, -1]
        return codes.cpu()
    return run


def floor_ms(model: TTSModel, batch: int, bandwidth: float) -> float:
    """Weight bytes of one forward (backbone + head + one code row) × 26 forwards / bandwidth."""
    per_fwd = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n.startswith(("model.", "head_code.")))
    return 26 * per_fwd / bandwidth * 1e3


def stats(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"median_ms": statistics.median(ordered),
            "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (smoke run)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,32; tiny: 1,4)")
    ap.add_argument("--rows", type=int, default=16, help="text rows per unit")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile + graph column")
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="bytes/s (H200 copy, targets.md)")
    ap.add_argument("--json", default="out/bench_tts.json")
    args = ap.parse_args()

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batches = [int(x) for x in (args.batches or ("1,4" if args.tiny else "1,8,32")).split(",")]
    iters = args.iters or (3 if args.tiny else 30)
    cfg = make_cfg(args.tiny)
    model = make_model(cfg, device, dtype)
    ecfg = TTSEngineConfig(max_sessions=max(batches), max_batch=max(batches), max_turn_positions=1024)
    engine = TTSEngine(model, ecfg)
    compiled = None
    if device == "cuda" and not args.no_compile:
        compiled = TTSEngine(model, replace(ecfg, compile_step=True))
    for e in (engine, compiled):
        for b in range(max(batches)):
            if e is not None:
                e.open(f"s{b}", FENCE, seed=b)
    timer, rows = Timer(device), []
    for batch in batches:
        reqs = requests(cfg, batch, args.rows, device)
        rec: dict[str, object] = {"batch": batch, "floor_ms": floor_ms(model, batch, args.bandwidth)}
        rec["engine_eager"] = stats(timer(engine_unit(engine, reqs, False), iters, args.warmup))
        if device == "cuda":
            rec["engine_graph"] = stats(timer(engine_unit(engine, reqs, True), iters, args.warmup))
            rec["graph_step_replays"] = stats(timer(replays(engine, batch), iters, 1))
        if compiled is not None:
            t0 = time.perf_counter()
            engine_unit(compiled, reqs, True)()
            rec["compile_s"] = time.perf_counter() - t0
            rec["engine_compiled"] = stats(timer(engine_unit(compiled, reqs, True), iters, args.warmup))
            rec["compiled_step_replays"] = stats(timer(replays(compiled, batch), iters, 1))
        if not args.skip_hf:
            rec["hf_ref"] = stats(timer(hf_unit(model, reqs, device), max(3, iters // 3), 1))
        rows.append(rec)
        print(json.dumps(rec), flush=True)

    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
            "rows": args.rows, "iters": iters, "tiny": args.tiny, "torch": torch.__version__}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"\nTTS one unit (25 codes, {args.rows} rows), {meta['device']}, ms median / p99")
    print(f"{'batch':>5} {'floor':>7} {'eager':>15} {'graph':>15} {'compiled':>15} {'hf-ref':>15} "
          f"{'hf/best':>8}")
    def cell(r: dict[str, object], key: str) -> str:
        s = r.get(key)
        return f"{s['median_ms']:7.2f}/{s['p99_ms']:7.2f}" if isinstance(s, dict) else f"{'-':>15}"

    for r in rows:
        best = min((r[k] for k in ("engine_eager", "engine_graph", "engine_compiled") if k in r),
                   key=lambda x: x["median_ms"])
        ratio = (f"{r['hf_ref']['median_ms'] / best['median_ms']:8.1f}" if "hf_ref" in r
                 else f"{'-':>8}")
        print(f"{r['batch']:>5} {r['floor_ms']:7.2f} {cell(r, 'engine_eager')} {cell(r, 'engine_graph')} {cell(r, 'engine_compiled')} "
              f"{cell(r, 'hf_ref')} {ratio}")


if __name__ == "__main__":
    main()
