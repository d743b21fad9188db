"""A Stage0 unit with a camera frame (issue 17): what a 448² frame adds to a unit, at full size on a GPU.

    python bench/bench_camera.py --batches 1,8 --json camera.json     # H200 (dummy weights, bf16)
    python bench/bench_camera.py --tiny                                # CPU smoke test on tiny shapes

Rows (median / p99 ms):
- `decode+resize <W>x<H> JPEG`: Pillow decode and bicubic resize to the slice (engine/model/frames.py), host
  only, one frame; the stage0 bridge does it on the adapter's thread, off the engine thread.
- `vision encode N x 448²`: SigLIP (26 layers) + resampler over N frames in one batch (what one engine step
  does for N sessions' frames).
- `unit step N sessions, frame|no frame`: the engine step that starts N sessions' units: batched audio front
  end + vision + the unit prefill (`<unit>` + 66 + 10 positions with a frame) + the first draw.
- `unit N sessions, frame|no frame`: append -> the unit's UnitDone for N sessions at once, every unit a
  scripted speak unit of `max_steps` tokens (§9.5), so the difference is the frame's cost in a whole unit.
The sessions hold `--context` retained positions (random KV), like a session in its steady state.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_load import full_size_config
from bench.bench_stage0 import FULL, TINY, BenchTokenizer, dummy_init, stats
from bench.stage0_frontend import FULL_AUDIO, TINY_AUDIO, build_frontend
from engine.config import ModelConfig, VisionConfig
from engine.model.llm import Qwen3LLM
from engine.model.vision import Resampler, SiglipVisionTower
from engine.stage0 import DecodeRules, Fence, SamplingParams, Stage0Config, Stage0Engine
from engine.stage0.frontend import AudioFrontEndAdapter, VisionFrames
from engine.stage0.script import ScriptPlan
from engine.stage0.session import UnitRecord

FRAME_SIDE = 448


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="JPEG", quality=70)  # protocol.md §9.4 V-6
    return out.getvalue()


def timed(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> tuple[float, float]:
    fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return stats(samples)


def build(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> tuple[Qwen3LLM, VisionFrames, object]:
    vcfg = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        patch_size=14, image_size=28, query_num=64) if args.tiny else \
        ModelConfig.from_dict(full_size_config()).vision
    llm_cfg = TINY if args.tiny else FULL
    with torch.device(dev):
        model = Qwen3LLM(llm_cfg).to(dtype).eval()
        tower = SiglipVisionTower(vcfg).to(dtype).eval()
        resampler = Resampler(vcfg, llm_cfg.hidden_size).to(dtype).eval()
    for module in (model, tower, resampler):
        dummy_init(module)
    audio = build_frontend(TINY_AUDIO if args.tiny else FULL_AUDIO, llm_cfg.hidden_size, dev, dtype)
    return model, VisionFrames(tower, resampler), audio


def engine_for(model: Qwen3LLM, vision: VisionFrames, audio: object, b: int, args: argparse.Namespace,
               dev: torch.device) -> Stage0Engine:
    rules = DecodeRules(force_listen_count=0)
    room = (args.units + 3) * Stage0Config().unit_max_positions(rules)
    config = Stage0Config(max_sessions=b, eviction="off", max_context=args.context + room,
                          use_cuda_graphs=dev.type == "cuda", merge_unit_close=True, scripted_decisions=True,
                          benchmark_mode=True, script_plan=ScriptPlan(listen_units=0, tail_listen_units=0))
    tok = BenchTokenizer(model.cfg.vocab_size)
    engine = Stage0Engine(model, tok, AudioFrontEndAdapter(audio, vision), lambda event: None, config, rules)
    for i in range(b):
        engine.open(f"s{i}", Fence(1, 0), params=SamplingParams(seed=i))
    engine.run_until_idle()
    kv = engine.runner.kv
    for i in range(b):  # `context` retained positions: random KV, one ledger entry
        s = engine.session(f"s{i}")
        for t in (*kv.k, *kv.v):
            t[s.slot, :, s.cached_len:args.context].normal_()
        s.ledger.append(UnitRecord(-1, args.context - s.prefix_len, (), "", True))
        s.cached_len = args.context
    return engine


def bench_units(engine: Stage0Engine, b: int, frame: bytes | None, args: argparse.Namespace,
                sync: Callable[[], None]) -> dict[str, tuple[float, float]]:
    cfg, steps, units = engine.config, [], []
    for k in range(args.units + 1):  # unit 0 warms up (and captures graphs)
        for i in range(b):
            n = cfg.first_unit_samples if k == 0 else cfg.unit_samples
            engine.append(f"s{i}", Fence(1, 0, seq=k + 1), torch.randn(n) * 0.1, () if frame is None else (frame,))
        sync()
        t0 = time.perf_counter()
        first = True
        while True:
            t1 = time.perf_counter()
            busy = engine.step()
            sync()
            if first and k:
                steps.append((time.perf_counter() - t1) * 1e3)
            first = False
            if not busy:
                break
        if k:
            units.append((time.perf_counter() - t0) * 1e3)
    return {"unit step": stats(steps), "unit": stats(units)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--units", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.tiny:
        args.context, args.units, args.iters = 256, 2, 3
    model, vision, audio = build(args, dev, dtype)
    rows: list[dict] = []
    for w, h in ((640, 480), (FRAME_SIDE, FRAME_SIDE)):
        data = jpeg(w, h)
        rows.append({"name": f"decode+resize {w}x{h} JPEG", "batch": 1,
                     "ms": timed(lambda data=data: vision.prepare_frame(data), args.iters, lambda: None)})
    square = vision.prepare_frame(jpeg(FRAME_SIDE, FRAME_SIDE))
    for b in [int(x) for x in args.batches.split(",")]:
        rows.append({"name": f"vision encode {b} x 448²", "batch": b,
                     "ms": timed(lambda b=b: vision.encode_frames([square] * b), args.iters, sync)})
        for label, frame in (("no frame", None), ("frame 448²", jpeg(FRAME_SIDE, FRAME_SIDE))):
            engine = engine_for(model, vision, audio, b, args, dev)
            for name, ms in bench_units(engine, b, frame, args, sync).items():
                rows.append({"name": f"{name} {b} sessions, {label}", "batch": b, "ms": ms})
            del engine
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{'row':<44} {'median ms':>10} {'p99 ms':>9}   ({dev}, {dtype}, context {args.context})")
    for r in rows:
        print(f"{r['name']:<44} {r['ms'][0]:>10.2f} {r['ms'][1]:>9.2f}")
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": str(dtype),
              "context": args.context, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
