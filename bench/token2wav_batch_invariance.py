"""Does a session's Token2Wav audio depend on who shares its step? (issue 16, model.md I9, at full size)

The Token2Wav half of bench/tts_batch_invariance.py: one watched session renders a turn of three units (the same
codes, voice and seed every time) alone and among n-1 other sessions rendering their own turns in the same
steps, through `Token2WavEngine.step()` built as the Triton bridge builds it (slot pool, row buckets, CUDA graphs
made at warm-up on the GPU); its PCM is compared byte for byte. Full-size flow and HiFT, random weights, the h200
profiles' float16 flow:
    python bench/token2wav_batch_invariance.py --json out.json
Per n it also says which part differs first: the watched row of the flow encoder's output, the flow's mel, the
HiFT's float speech (max |diff| over the turn's calls, and the first call that differs), and the mean engine step
time (ms, the GPU synchronized). `--watched-last` puts the watched session last in the steps instead of first (a
row's place in its batch must not matter either); `--no-cudnn` turns cuDNN off for the whole run, graphs included;
`--tile-rows K` runs every flow and HiFT batch on exactly K rows (the engine's `tile_rows`).
CPU smoke test (tiny dims, fp32): python bench/token2wav_batch_invariance.py --tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

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


HALVES = ("mu", "mel", "speech")  # the flow encoder's output, the flow's mel, the HiFT's float speech


class Tracer:
    """Per call of the watched session (t0): its row of the flow encoder's output, its mel and its float speech,
    recorded around the engine's own flow and HiFT code (which part makes a difference)."""

    def __init__(self, engine: Token2WavEngine) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self.row: int | None = None
        self.chunk = 0   # the flow call of the step (one per tile of rows)
        run_flow, encode = engine._run_flow, engine.solver.encode

        def flow(work: list) -> None:   # the watched row among the step's flow rows
            sids = [sid for sid, _, item in work if item.call is not None]
            self.row = sids.index("t0") if "t0" in sids else None
            self.chunk = 0
            run_flow(work)

        def encoder(*args: Any) -> tuple[torch.Tensor, ...]:
            out = encode(*args)
            tile = engine.cfg.tile_rows or len(out[0])   # with tiles the step's rows come in chunks of the tile
            if self.row is not None and self.row // tile == self.chunk:
                self.calls.append({"mu": out[0][self.row % tile].float().cpu()})
            self.chunk += 1
            return out
        engine._run_flow, engine.solver.encode = flow, encoder  # type: ignore[method-assign]

    def watch(self, stream: Any) -> None:
        """Record the watched stream's mel and speech as its HiFT output is finished (one per flow call)."""
        self.calls, finish, finished = [], stream.finish_phase, itertools.count()

        def record(call: Any, mel_in: torch.Tensor, speech: torch.Tensor, source: torch.Tensor) -> np.ndarray:
            self.calls[next(finished)].update(mel=call.mel.float().cpu(), speech=speech.float().cpu())
            return finish(call, mel_in, speech, source)
        stream.finish_phase = record


def watched_pcm(engine: Token2WavEngine, tracer: Tracer, vocab: int, n: int, last: bool = False
                ) -> tuple[bytes, float, list[dict[str, torch.Tensor]]]:
    """The watched session's (t0's) PCM of one turn with n sessions rendering theirs in the same steps, t0 the
    first session of the steps or with `last` the last; the mean step time in ms; and the tracer's calls."""
    order = list(range(1, n)) + [0] if last else list(range(n))
    for i in order:
        engine.open(f"t{i}", FENCE, "v", seed=1000 + i)
    tracer.watch(engine.sessions["t0"].stream)
    for unit in range(UNITS):
        for i in order:
            engine.submit(f"t{i}", FENCE, unit, turn_codes(vocab, i)[unit], end_of_turn=unit == UNITS - 1)
    pcm, steps, t0 = [], 0, time.perf_counter()
    while engine.pending():
        pcm += [c.pcm.tobytes() for c in engine.step() if c.session_id == "t0"]
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t0) / max(steps, 1)
    for i in order:
        engine.close(f"t{i}", FENCE)
    return b"".join(pcm), step_ms, tracer.calls


def trace_diff(alone: list[dict[str, torch.Tensor]], got: list[dict[str, torch.Tensor]]) -> dict:
    """Per traced half: '=' or the max |diff| over the calls; and the first call where any half differs."""
    if len(alone) != len(got):
        return dict({h: "calls differ" for h in HALVES}, first_call=None)
    out, first = {}, None
    for h in HALVES:
        worst = 0.0
        for c, (a, b) in enumerate(zip(alone, got, strict=True)):
            d = float((a[h] - b[h]).abs().max()) if a[h].shape == b[h].shape else float("inf")
            if d and (first is None or c < first):
                first = c
            worst = max(worst, d)
        out[h] = "=" if worst == 0 else f"{worst:.2g}"
    return dict(out, first_call=first)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (smoke test)")
    ap.add_argument("--counts", default="2,4,8,16,32", help="sessions in the steps besides 1, comma separated")
    ap.add_argument("--flow-dtype", choices=("fp32", "fp16"), default=None, help="default: fp16 on CUDA")
    ap.add_argument("--prompt-tokens", type=int, default=250, help="voice prompt tokens (250: 10 s)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (is a difference the graphs' or the kernels'?)")
    ap.add_argument("--no-cudnn", action="store_true", help="torch.backends.cudnn.enabled = False (graphs too)")
    ap.add_argument("--watched-last", action="store_true", help="the watched session last in the steps, not first")
    ap.add_argument("--tile-rows", type=int, default=0, help="every flow and HiFT batch on exactly K rows (0: buckets)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    torch.backends.cudnn.enabled = not args.no_cudnn
    flow_dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.flow_dtype or (
        "fp16" if device.type == "cuda" else "fp32")]
    counts = [int(c) for c in args.counts.split(",") if c]
    top = max(counts + [1])
    models = build_models(args.tiny, device, flow_dtype)
    buckets = row_buckets(top)
    graphs = device.type == "cuda" and not args.eager
    engine = Token2WavEngine(models, Token2WavEngineConfig(
        max_batch=top, use_cuda_graphs=graphs, pool=PoolConfig(slots=top), tile_rows=args.tile_rows,
        max_graphs=GRAPHS_PER_BUCKET * len(buckets)))
    tracer = Tracer(engine)
    vocab = models.flow_cfg.vocab_size
    engine.add_voice("v", make_voice(min(args.prompt_tokens, 20) if args.tiny else args.prompt_tokens, vocab))
    if graphs:
        engine.warm_up("v", lambda line: None)
    alone, alone_ms, alone_trace = watched_pcm(engine, tracer, vocab, 1)
    rows = [dict(sessions=1, step_ms=round(alone_ms, 2))]
    for n in counts:
        got, step_ms, trace = watched_pcm(engine, tracer, vocab, n, args.watched_last)
        a, b = np.frombuffer(alone, np.int16), np.frombuffer(got, np.int16)
        diff = int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) if len(a) == len(b) else None
        rows.append(dict(sessions=n, equal_alone=got == alone, samples=len(b), max_abs_diff_lsb=diff,
                         step_ms=round(step_ms, 2), **trace_diff(alone_trace, trace)))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    options = dict(cudnn=not args.no_cudnn, watched_last=args.watched_last, tile_rows=args.tile_rows)
    print(f"Token2Wav: the watched session's turn ({len(alone) // 2} samples) alone vs among n ({name}, flow "
          f"{flow_dtype}, graphs {graphs}, {options}); misses {engine.misses.counts()}")
    print(f"  n =   1: step {alone_ms:.1f} ms")
    for r in rows[1:]:
        note = "equal" if r["equal_alone"] else f"DIFFER (max |diff| {r['max_abs_diff_lsb']} LSB)"
        print(f"  n = {r['sessions']:3d}: {note}, step {r['step_ms']:.1f} ms; flow encoder {r['mu']}, flow mel "
              f"{r['mel']}, HiFT speech {r['speech']} (first differing call {r['first_call']})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, flow_dtype=str(flow_dtype), samples=len(alone) // 2,
                                                   **options, misses=engine.misses.counts(), results=rows),
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
