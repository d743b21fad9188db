"""Does a session's TTS unit depend on who shares its step? (issue 16, model.md I9, at full size)

Stage0's rows were batch-dependent at full size until its graphs padded their GEMMs and its decode attention
became flex (bench/RESULTS.md stop 37); the TTS runs GEMMs of 1-32 rows too. This runs one watched session's unit
(`--rows` text rows, mid-turn: EOS masked, 25 codes) through `TTSEngine.step()` alone and among n-1 other sessions'
units, the same seeds and inputs every time, and compares the watched session's 25 codes (each sample feeds the
next step, so any difference in a logit that flips one draw shows). Full-size TTS shapes, random bf16 weights:
    python bench/tts_batch_invariance.py --compile --json out.json          # H200: graphs, compiled step
CPU smoke test (tiny dims, fp32): python bench/tts_batch_invariance.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_tts import FENCE, MID_TURN_POS, make_cfg, make_model, requests  # noqa: E402
from engine.stage1.config import TTSEngineConfig  # noqa: E402
from engine.stage1.tts_engine import TTSEngine  # noqa: E402


def watched_codes(engine: TTSEngine, reqs: list, n: int) -> tuple[int, ...]:
    """The watched session's (s0's) codes with n sessions in the step: every session opened afresh with its
    own fixed seed, at the same turn position, its unit submitted, one step."""
    for sid in list(engine.sessions):
        engine.close(sid, FENCE)
    for i in range(n):
        engine.open(f"s{i}", FENCE, seed=1000 + i)
        engine.sessions[f"s{i}"].tts_pos = MID_TURN_POS
        engine.submit(reqs[i])
    results = {r.session_id: r for r in engine.step()}
    assert len(results) == n, f"{len(results)} results for {n} sessions (max_batch too small?)"
    return results["s0"].codes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (smoke test)")
    ap.add_argument("--counts", default="2,4,8,16,32", help="sessions in the step besides 1, comma separated")
    ap.add_argument("--rows", type=int, default=16, help="text rows per unit")
    ap.add_argument("--compile", action="store_true", help="compiled step (the h200 profiles' compile_step)")
    ap.add_argument("--tile-rows", type=int, default=0, help="every TTS GEMM on exactly that many rows (gemm_tile_rows)")
    ap.add_argument("--buckets", default="", help="batch buckets, comma separated (default: the engine's; "
                    "without 1 a lone unit runs padded to 2, as stage0's graphs do)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    counts = [int(c) for c in args.counts.split(",") if c]
    top = max(counts + [1])
    cfg = make_cfg(args.tiny)
    model = make_model(cfg, device, dtype)
    buckets = {"batch_buckets": tuple(int(b) for b in args.buckets.split(","))} if args.buckets else {}
    engine = TTSEngine(model, TTSEngineConfig(max_sessions=top, max_batch=top, max_turn_positions=1024,
                                              compile_step=args.compile, gemm_tile_rows=args.tile_rows, **buckets))
    reqs = requests(cfg, top, args.rows, device)  # reqs[0] is the watched unit at every count
    alone = watched_codes(engine, reqs, 1)
    rows = []
    for n in counts:
        got = watched_codes(engine, reqs, n)
        first = next((i for i, (a, b) in enumerate(zip(alone, got, strict=True)) if a != b), None)
        rows.append(dict(sessions=n, equal_alone=got == alone, first_difference=first))
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"TTS: the watched session's {len(alone)} codes alone vs among n ({device_name}, {dtype}, "
          f"{'compiled' if args.compile else 'eager'} step, graphs {engine.runner.use_graphs}, GEMM tile "
          f"{args.tile_rows} rows, buckets {engine.cfg.batch_buckets})")
    for r in rows:
        where = "" if r["equal_alone"] else f" (first difference at code {r['first_difference']})"
        print(f"  n = {r['sessions']:3d}: {'equal' if r['equal_alone'] else 'DIFFER'}{where}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device_name, dtype=str(dtype), compile=args.compile,
                                                   tile_rows=args.tile_rows, buckets=list(engine.cfg.batch_buckets),
                                                   graphs=engine.runner.use_graphs, rows=args.rows, codes=len(alone),
                                                   results=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
