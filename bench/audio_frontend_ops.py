"""Host work of the batched streaming encoder per call (issue 15), measured without a GPU.

    python bench/audio_frontend_ops.py --batches 1,16,64 --stagger 8
    python bench/audio_frontend_ops.py --baseline /tmp/old_batched.py   # another forward_stream_batch, e.g. an old one

One call = `engine.audio.batched.forward_stream_batch` for N sessions' units at the real Whisper-medium encoder
dims (bench/stage0_frontend.py FULL_AUDIO, bf16), every unit a later one (104 mel frames, 2 redundancy frames
per side). Session i has `ctx - 50 * (i % stagger)` cached frames, the served stagger: the attention then runs
under the padding mask. Two figures per batch size:
- ops: the ATen ops the call dispatches, counted with a TorchDispatchMode (views and copies included), on CPU
  tensors at the tiny encoder width but the full layer count (the count does not depend on the width);
- host ms: the call's wall time on the `meta` device at full size, where no op computes: what is left is the
  Python, dispatcher and shape work, a proxy for the host time a GPU step spends before its kernels run.
`--baseline FILE` loads `forward_stream_batch` from FILE and gives it private caches (`allocate_cache`), as the
front end did before the audio KV pool; otherwise the sessions' caches come from one `AudioKVPool`.
`--whole` counts the ops of the whole `AudioFrontEnd.encode_units` instead (PCM push, the mel windows and their
batched log-mel, the encoder, the projector), sessions streamed to the stagger first, each with a pool slot
where the tree's front end has a pool; run from a copy of an older tree it gives that tree's figure:

    git archive 023fa67 engine bench | tar -x -C /tmp/pre_pool
    cp bench/audio_frontend_ops.py /tmp/pre_pool/bench/ && python /tmp/pre_pool/bench/audio_frontend_ops.py --whole
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.stage0_frontend import FULL_AUDIO
from engine.audio import AudioFrontEnd, StreamConfig, UnitMel
from engine.audio.mel import FloorMode
from engine.model.audio import AudioKVCache, AudioProjector, WhisperEncoder

UNIT_FRAMES = 104  # a later unit's mel slice: 100 frames + 2 redundancy frames per side
# the op count does not depend on the width, only on the layer count: tiny width, full depth (fast on 2 cores)
COUNT_AUDIO = dataclasses.replace(FULL_AUDIO, d_model=64, encoder_attention_heads=4, encoder_ffn_dim=256)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the mode's protocol
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _load(path: Path | None):  # noqa: ANN202 - a forward_stream_batch
    if path is None:
        from engine.audio.batched import forward_stream_batch

        return forward_stream_batch
    spec = importlib.util.spec_from_file_location("baseline_batched", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forward_stream_batch


def _setup(cfg, dev: str, n: int, ctx: int, stagger: int, private: bool):  # noqa: ANN001, ANN202
    with torch.device(dev):
        enc = WhisperEncoder(cfg).to(torch.bfloat16 if dev == "meta" else torch.float32).eval()
    if private:
        caches = [enc.allocate_cache() for _ in range(n)]
    else:
        from engine.model.audio import AudioKVPool

        pool = AudioKVPool.allocate(cfg, n, enc.conv1.weight.device, enc.conv1.weight.dtype)
        caches = [pool.take() for _ in range(n)]
    lengths = [ctx - 50 * (i % stagger) for i in range(n)]
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(cfg.num_mel_bins, UNIT_FRAMES, generator=g).to(dev)
    red = StreamConfig().redundancy_frames
    units = [UnitMel(mel=mel, unit=ctx // 50, frames=(0, UNIT_FRAMES), prefix_extra=red, suffix_extra=red,
                     floor=FloorMode.DYNAMIC, buffer_samples=0, base_sample=0) for _ in range(n)]
    return enc, units, caches, lengths


def _call(fn, enc, units, caches: list[AudioKVCache], lengths: list[int]) -> None:  # noqa: ANN001
    for c, n in zip(caches, lengths, strict=True):  # every call at the same stream point
        c.length = n
    with torch.inference_mode():
        fn(enc, units, caches)


def count_ops(fn, n: int, ctx: int, stagger: int, private: bool) -> Counter[str]:  # noqa: ANN001
    enc, units, caches, lengths = _setup(COUNT_AUDIO, "cpu", n, ctx, stagger, private)
    _call(fn, enc, units, caches, lengths)
    with OpCounter() as counter:
        _call(fn, enc, units, caches, lengths)
    return counter.ops


def count_encode_units(n: int, stagger: int) -> Counter[str]:
    """Ops of one `encode_units` over n sessions, session i (i % stagger) units behind session 0."""
    torch.manual_seed(0)
    enc, proj = WhisperEncoder(COUNT_AUDIO).eval(), AudioProjector(COUNT_AUDIO.d_model, 128).eval()
    pooled = "kv_slots" in inspect.signature(AudioFrontEnd).parameters
    fe = AudioFrontEnd(enc, proj, COUNT_AUDIO, **({"kv_slots": n} if pooled else {}))
    states = [fe.new_session() for _ in range(n)]
    cfg = StreamConfig()

    def pcm(unit: int) -> torch.Tensor:
        return 0.1 * torch.randn(cfg.first_chunk_samples - cfg.prefix_zeros if unit == 0 else cfg.chunk_samples)

    targets = [stagger - i % stagger for i in range(n)]  # units done before the counted call: 1..stagger
    while behind := [s for s, t in zip(states, targets, strict=True) if s.next_unit < t]:
        fe.encode_units(behind, [pcm(s.next_unit) for s in behind])
    pcms = [pcm(s.next_unit) for s in states]
    with OpCounter() as counter:
        fe.encode_units(states, pcms)
    return counter.ops


def host_ms(fn, batches: list[int], ctx: int, stagger: int, iters: int, private: bool) -> dict[int, float]:  # noqa: ANN001
    """Median wall ms per call on `meta` at full size; the batch sizes take turns (the machine's load drifts)."""
    setups = {n: _setup(FULL_AUDIO, "meta", n, ctx, stagger, private) for n in batches}
    times: dict[int, list[float]] = {n: [] for n in batches}
    for k in range(iters + 3):
        for n, (enc, units, caches, lengths) in setups.items():
            t0 = time.perf_counter()
            _call(fn, enc, units, caches, lengths)
            if k >= 3:  # warm-up calls not counted
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--stagger", type=int, default=8, help="sessions spread over K units (padding mask)")
    ap.add_argument("--ctx", type=int, default=1200, help="cached frames of session 0 (unit 24)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--baseline", type=Path, default=None, help="a file with another forward_stream_batch")
    ap.add_argument("--whole", action="store_true", help="ops of the whole encode_units (no timing)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.whole:
        print(f"{'sessions':>8s} {'ops/call':>8s}  most frequent ops (AudioFrontEnd.encode_units)")
        for n in args.batches.split(","):
            ops = count_encode_units(int(n), args.stagger)
            print(f"{int(n):8d} {sum(ops.values()):8d}  {', '.join(f'{k} {c}' for k, c in ops.most_common(6))}")
        return 0
    fn = _load(args.baseline)
    private = args.baseline is not None
    batches = [int(n) for n in args.batches.split(",")]
    ms = host_ms(fn, batches, args.ctx, args.stagger, args.iters, private)
    rows = []
    for n in batches:
        ops = count_ops(fn, n, args.ctx, args.stagger, private)
        rows.append(dict(batch=n, stagger=args.stagger, ctx=args.ctx, ops=sum(ops.values()), top=ops.most_common(6),
                         host_ms=ms[n]))
    print(f"{'sessions':>8s} {'ops/call':>8s} {'host ms (meta)':>14s}  most frequent ops")
    for r in rows:
        top = ", ".join(f"{name} {c}" for name, c in r["top"])
        print(f"{r['batch']:8d} {r['ops']:8d} {r['host_ms']:14.2f}  {top}")
    if args.json:
        args.json.write_text(json.dumps({"baseline": str(args.baseline or ""), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
