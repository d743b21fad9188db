"""P11: a session's Stage0 KV over one hour stays inside the eviction window (targets.md P11).

The stage0 engine as its Triton model builds it (the stage0 bridge over the seeded tiny checkpoint, on the CPU),
one session streaming `--units` one-second units (3600 = one hour of audio) through the real audio front end,
on the scripted plan of the h200-scripted profile (3 listen units, then a 3-unit turn of 4 text ids each: the KV
fills with text as well as audio) and the h200 profile's window (`--kv-window` 8192; eviction drops old units to
0.75 of it, model.md §7.4). Every `--every` units it records the session's KV length (with an owed close), its
ledger of units, the units evicted so far, the audio encoder's KV length and resets, the Step-B draws (all, and
those the session keeps for its repetition penalty), and the process RSS. Prints a table; writes JSON.

    python bench/kv_growth.py --units 3600 --json kv.json

P11 holds when the KV length never exceeds the window (kv_window) and does not grow after the first eviction,
and the RSS stops growing after warm-up. The tiny model's KV per position is small; the lengths are the model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.soak import rss_mb  # noqa: E402
from build.make_tiny_checkpoint import build_tiny_checkpoint  # noqa: E402
from engine.stage0 import Fence, SamplingParams  # noqa: E402
from model_repository.common import bridges  # noqa: E402
from model_repository.common.settings import StageSettings  # noqa: E402

PLAN = {"listen_units": 3, "speak_units": 3, "text_ids_per_unit": 4, "tail_listen_units": 0}  # h200-scripted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=3600, help="one-second units (3600 = one hour)")
    ap.add_argument("--every", type=int, default=300, help="record every N units")
    ap.add_argument("--kv-window", type=int, default=8192)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_tiny_checkpoint(Path(tmp) / "ckpt", 0, vision=False)
        settings = StageSettings(stage="stage0", engine_factory="model_repository.common.bridges:stage0",
                                 checkpoint_dir=str(ckpt), device="cpu", dtype="float32", max_sessions=1,
                                 kv_window=args.kv_window, session_idle_ttl_s=60,
                                 engine_options=json.dumps({"scripted_decisions": PLAN}))
        bridge = bridges.stage0(settings)
    engine, config = bridge.engine, bridge.engine.config
    clip = bridge.voice_clips.get(bridge.default_voice)
    engine.open("s", Fence(1, 0), ref_audio=clip, params=SamplingParams(seed=1))
    g = torch.Generator().manual_seed(1)
    rows, t0, peak = [], time.perf_counter(), 0
    for unit in range(args.units):
        n = config.first_unit_samples if unit == 0 else config.unit_samples
        engine.append("s", Fence(1, 0, seq=unit), 0.1 * torch.randn(n, generator=g))
        engine.run_until_idle()
        s = engine.session("s")
        s.check_accounting()  # I12 every unit: the ledger sums to the cache
        peak = max(peak, s.owed_len)
        if (unit + 1) % args.every == 0 or unit + 1 == args.units:
            audio = s.frontend_state
            rows.append({"unit": unit + 1, "kv_len": s.owed_len, "kv_peak": peak, "ledger_units": len(s.ledger),
                         "evicted_units": s.ledger[0].index if s.ledger else None, "prefix_len": s.prefix_len,
                         "audio_kv_len": audio.kv.length, "audio_kv_resets": audio.kv.resets,
                         "draws": len(s.history), "draws_kept": len(list(s.history)),
                         "rss_mib": rss_mb([os.getpid()]),
                         "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    out = {"what": "P11 Stage0 KV over a long session (tiny checkpoint, CPU)", "units": args.units,
           "kv_window": args.kv_window, "window_high": config.window_high, "window_low": config.window_low,
           "slot_positions": config.slot_len(engine.rules), "plan": PLAN, "rows": rows}
    print(f"\nwindow {config.window_low}..{config.window_high}, slot {out['slot_positions']} positions")
    print("unit | KV len | KV peak | units kept | evicted | audio KV (resets) | Step-B draws (kept) | RSS MiB")
    for r in rows:
        print(f"{r['unit']} | {r['kv_len']} | {r['kv_peak']} | {r['ledger_units']} | {r['evicted_units']} | "
              f"{r['audio_kv_len']} ({r['audio_kv_resets']}) | {r['draws']} ({r['draws_kept']}) | {r['rss_mib']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
