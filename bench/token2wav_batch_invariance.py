"""Does a session's Token2Wav audio depend on who shares its step? (issue 16, model.md I9, at full size)

The Token2Wav half of bench/tts_batch_invariance.py: one watched session renders a turn of three units (the same
codes, voice and seed every time) alone and among n-1 other sessions rendering their own turns in the same
steps, through `Token2WavEngine.step()` built as the Triton bridge builds it (slot pool, row buckets, CUDA graphs
made at warm-up on the GPU); its PCM is compared byte for byte. Full-size flow and HiFT, random weights, the h200
profiles' float16 flow:
    python bench/token2wav_batch_invariance.py --json out.json
CPU smoke test (tiny dims, fp32): python bench/token2wav_batch_invariance.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_token2wav import GRAPHS_PER_BUCKET, build_models, make_voice  # noqa: E402
from engine.stage1.token2wav_engine import Token2WavEngine, Token2WavEngineConfig  # noqa: E402
from engine.stage1.types import Fence  # noqa: E402
from engine.token2wav.buckets import row_buckets  # noqa: E402
from engine.token2wav.pool import PoolConfig  # noqa: E402

FENCE = Fence(1, 0)
UNITS = 3  # a turn: two steady units and an end-of-turn unit


def turn_codes(vocab: int, session: int) -> list[list[int]]:
    rng = np.random.default_rng(100 + session)
    return [rng.integers(0, vocab, 25 if u < UNITS - 1 else 12).tolist() for u in range(UNITS)]


def watched_pcm(engine: Token2WavEngine, vocab: int, n: int) -> bytes:
    """The watched session's (t0's) PCM of one turn with n sessions rendering theirs in the same steps."""
    sids = [f"t{i}" for i in range(n)]
    for i, sid in enumerate(sids):
        engine.open(sid, FENCE, "v", seed=1000 + i)
    for unit in range(UNITS):
        for i, sid in enumerate(sids):
            engine.submit(sid, FENCE, unit, turn_codes(vocab, i)[unit], end_of_turn=unit == UNITS - 1)
    pcm = []
    while engine.pending():
        pcm += [c.pcm.tobytes() for c in engine.step() if c.session_id == "t0"]
    for sid in sids:
        engine.close(sid, FENCE)
    return b"".join(pcm)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (smoke test)")
    ap.add_argument("--counts", default="2,4,8,16,32", help="sessions in the steps besides 1, comma separated")
    ap.add_argument("--flow-dtype", choices=("fp32", "fp16"), default=None, help="default: fp16 on CUDA")
    ap.add_argument("--prompt-tokens", type=int, default=250, help="voice prompt tokens (250: 10 s)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (is a difference the graphs' or the kernels'?)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    flow_dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.flow_dtype or (
        "fp16" if device.type == "cuda" else "fp32")]
    counts = [int(c) for c in args.counts.split(",") if c]
    top = max(counts + [1])
    models = build_models(args.tiny, device, flow_dtype)
    buckets = row_buckets(top)
    graphs = device.type == "cuda" and not args.eager
    engine = Token2WavEngine(models, Token2WavEngineConfig(
        max_batch=top, use_cuda_graphs=graphs, pool=PoolConfig(slots=top),
        max_graphs=GRAPHS_PER_BUCKET * len(buckets)))
    vocab = models.flow_cfg.vocab_size
    engine.add_voice("v", make_voice(min(args.prompt_tokens, 20) if args.tiny else args.prompt_tokens, vocab))
    if graphs:
        engine.warm_up("v", lambda line: None)
    alone = watched_pcm(engine, vocab, 1)
    rows = []
    for n in counts:
        got = watched_pcm(engine, vocab, n)
        a, b = np.frombuffer(alone, np.int16), np.frombuffer(got, np.int16)
        diff = int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) if len(a) == len(b) else None
        rows.append(dict(sessions=n, equal_alone=got == alone, samples=len(b), max_abs_diff_lsb=diff))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"Token2Wav: the watched session's turn ({len(alone) // 2} samples) alone vs among n ({name}, flow "
          f"{flow_dtype}, graphs {graphs}); misses {engine.misses.counts()}")
    for r in rows:
        note = "equal" if r["equal_alone"] else f"DIFFER (max |diff| {r['max_abs_diff_lsb']} LSB)"
        print(f"  n = {r['sessions']:3d}: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, flow_dtype=str(flow_dtype), samples=len(alone) // 2,
                                                   misses=engine.misses.counts(), results=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
