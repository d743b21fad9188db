"""Compiled warm-up: seconds and torch.compile (dynamo) compiles of the TTS and Stage0 graph sets.

Builds what a stage process builds at load with compile on (deploy profile h200: `tts.compile_step`,
`stage0.compile_mode: default`), for `--max-sessions` sessions and a `--kv-window` Stage0 window:
  tts     `TTSRunner.warm_up`: step + prefill graphs for batch buckets x kv buckets (x row buckets)
  stage0  `DecodeGraphs` + `PrefillGraphs` (batch x span, batch x length x span)
and prints, per engine, the warm-up seconds, the dynamo graphs compiled (each one an inductor compile)
then one JSON line. Steps that took more than `--slow` seconds are
listed (a compile or recompile shows up there).

    python bench/bench_compile_warmup.py --checkpoint /tmp/ckpt --max-sessions 32    # H200, full size
    python bench/bench_compile_warmup.py --tiny --max-sessions 32                    # CPU: tiny dims
    ... --baseline     # the whole forward / step compiled, as before regional compilation (comparison;
                       # the before figures in bench/RESULTS.md were taken on the code before that change)

On CPU there are no graphs: the TTS warm-up compiles its step per bucket, Stage0 replays eagerly
(`eager_replay`), both through inductor's CPU backend (needs a C compiler). Inductor's cache
(TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER) makes a second run faster; pass
`--fresh-cache` to measure a cold start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import LLMConfig, TTSConfig  # noqa: E402
from engine.model.llm import Qwen3LLM, SlotKVCache  # noqa: E402
from engine.model.tts import TTSModel  # noqa: E402
from engine.stage0.config import DecodeRules, Stage0Config  # noqa: E402
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs  # noqa: E402
from engine.stage1.config import TTSEngineConfig  # noqa: E402
from engine.stage1.runner import TTSRunner  # noqa: E402
from engine.weights import init_module_  # noqa: E402

WINDOW_LOW_FRACTION = 0.75  # as the Stage0 bridge sets window_low from the deploy profile's kv_window
# tests' tiny dims (tests/engine/test_tts_helpers.py, tests/engine/test_stage0_helpers.py)
TINY_TTS = TTSConfig(llm_dim=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                     num_audio_tokens=6562, num_text_tokens=320, audio_bos_token_id=317, text_eos_token_id=318)
TINY_LLM = LLMConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=40960,
                     rope_theta=1e6, rms_norm_eps=1e-6)


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return {"graphs": int(counters["stats"]["unique_graphs"])}


def measured(name: str, build: Callable[[Callable[[str], None]], None], slow: float) -> dict[str, object]:
    """Run `build(emit)`; report seconds, compiles and the slow progress steps."""
    import torch._dynamo
    torch._dynamo.reset()
    before = dynamo_counts()
    slow_steps: list[str] = []
    last = [time.perf_counter()]

    def emit(line: str) -> None:
        now = time.perf_counter()
        if now - last[0] > slow:
            slow_steps.append(f"{now - last[0]:.1f} s before: {line}")
        last[0] = now

    t0 = time.perf_counter()
    build(emit)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = dynamo_counts()
    rec = {"engine": name, "seconds": round(seconds, 1), **{k: after[k] - before[k] for k in after}}
    print(f"{name}: warm-up {seconds:.1f} s, {rec['graphs']} dynamo graphs compiled")
    for line in slow_steps:
        print(f"  slow: {line}")
    return {**rec, "slow_steps": slow_steps}


def tts_build(model: TTSModel, args: argparse.Namespace) -> Callable[[Callable[[str], None]], None]:
    cfg = TTSEngineConfig(max_sessions=args.max_sessions, max_batch=args.max_sessions, compile_step=True)

    def build(emit: Callable[[str], None]) -> None:
        runner = TTSRunner(model, cfg, dtype=model.emb_text.weight.dtype)
        if args.baseline:  # the whole step, as compiled before regional compilation
            import torch._dynamo
            torch._dynamo.config.recompile_limit = 64
            runner._layer_fn, runner._head_fn = None, runner._head
            runner._step = torch.compile(runner._step, fullgraph=True, dynamic=None)  # type: ignore[method-assign]
        runner.warm_up(emit)
    return build


def stage0_build(model: Qwen3LLM, args: argparse.Namespace) -> Callable[[Callable[[str], None]], None]:
    cfg = Stage0Config(max_sessions=args.max_sessions, window_high=args.kv_window,
                       window_low=max(1, int(args.kv_window * WINDOW_LOW_FRACTION)), compile_mode="default")
    if not model.fused:
        model.fuse_projections()  # as Stage0Engine does
    p = next(model.parameters())
    kv = SlotKVCache.allocate(model.cfg, cfg.max_sessions, cfg.slot_len(DecodeRules()), dtype=p.dtype,
                              device=p.device)
    eager_replay = p.device.type != "cuda"
    sets = (lambda: DecodeGraphs(model, kv, cfg.decode_batch_buckets, cfg.decode_kv_buckets,
                                 cfg.compile_mode, eager_replay, cfg.compile_dynamic),
            lambda: PrefillGraphs(model, kv, cfg.prefill_batch_buckets, cfg.prefill_lengths(),
                                  cfg.decode_kv_buckets, cfg.compile_mode, eager_replay, cfg.compile_dynamic))

    def build(emit: Callable[[str], None]) -> None:
        import torch._dynamo
        whole = torch.compile(model, mode=cfg.compile_mode, dynamic=cfg.compile_dynamic)
        for make in sets:
            graphs = make()
            if args.baseline:  # the whole forward, as compiled before regional compilation
                graphs._call = lambda st, kv=graphs.kv: whole(st.x, st.pos, st.slots, kv, valid=st.valid,
                                                              kv_limit=st.span)
                torch._dynamo.config.recompile_limit = 64
            graphs.capture()
            emit(f"{type(graphs).__name__}: {len(graphs.steps)} steps")
    return build


def load_models(args: argparse.Namespace) -> tuple[TTSModel | None, Qwen3LLM | None]:
    want = {"tts", "stage0"} if args.engine == "both" else {args.engine}
    if args.tiny:
        gen = torch.Generator().manual_seed(0)
        tts, llm = TTSModel(TINY_TTS), Qwen3LLM(TINY_LLM)
        init_module_(tts, gen)
        init_module_(llm, gen)
        return (tts.eval() if "tts" in want else None), (llm.eval() if "stage0" in want else None)
    from engine.loader import load_checkpoint
    parts = tuple(p for p, e in (("llm", "stage0"), ("tts", "tts")) if e in want)
    ck = load_checkpoint(args.checkpoint, device=args.device, dtype=torch.bfloat16, with_vision=False,
                         with_token2wav=False, components=parts)
    return ck.model.tts, ck.model.llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="full-size checkpoint directory (bf16 on --device)")
    src.add_argument("--tiny", action="store_true", help="tiny random fp32 models on the CPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-sessions", type=int, default=32)
    ap.add_argument("--kv-window", type=int, default=8192, help="Stage0 window_high (deploy kv_window)")
    ap.add_argument("--engine", choices=("tts", "stage0", "both"), default="both")
    ap.add_argument("--baseline", action="store_true", help="compile the whole forward (before this change)")
    ap.add_argument("--fresh-cache", action="store_true", help="an empty inductor cache (cold start)")
    ap.add_argument("--slow", type=float, default=1.0, help="list warm-up steps slower than this (s)")
    ap.add_argument("--json", type=Path, help="also write the records here")
    args = ap.parse_args()
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    if args.tiny:
        args.device = "cpu"
    tts, llm = load_models(args)
    records = []
    with torch.inference_mode():
        if tts is not None:
            records.append(measured("tts", tts_build(tts, args), args.slow))
    if llm is not None:  # the graph sets run under no_grad themselves, as in Stage0Engine
        records.append(measured("stage0", stage0_build(llm, args), args.slow))
    summary = {"device": args.device, "max_sessions": args.max_sessions, "kv_window": args.kv_window,
               "baseline": args.baseline, "torch": torch.__version__, "records": records}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
