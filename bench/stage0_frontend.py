"""The Stage0 audio front end at full size (issue 15, target: <= 15 ms for 64 units); bench_stage0.py runs
it too. Alone, on a GPU (prints a table, writes JSON):

    python bench/stage0_frontend.py --batches 1,32,64 --json fe.json

One timed call = `AudioFrontEnd.encode_units` for N sessions: push each session's 1 s of PCM, one batched
log-mel over every session's window (up to 30 s each, on the device), the streaming Whisper-medium encoder
over the N units against each session's audio KV (up to 1500 frames), the projector and the pool -> N x
[10, 4096]. The sessions are first streamed to `start_unit` (default 24: 25 s windows, 1200 cached
frames, the expensive end of a session's 30 s cycle), then the next `iters` units are timed, which
cross the 30 s window slide and the audio-KV reset (unit 29) like a long session does.
Weights are dummy N(0, 0.02) (model.md §9.5); the front end's cost does not depend on their values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from engine.audio import AudioFrontEnd, StreamConfig
from engine.config import AudioConfig
from engine.model.audio import AudioProjector, WhisperEncoder

# model.md §1.3: Whisper-medium with the 1500-frame (30 s) position table; projector 1024 -> 4096
FULL_AUDIO = AudioConfig(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                         num_mel_bins=80, max_source_positions=1500)
TINY_AUDIO = AudioConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256,
                         num_mel_bins=80, max_source_positions=1500)
WEIGHT_STD = 0.02
PCM_STD = 0.1


def build_frontend(cfg: AudioConfig, llm_hidden: int, dev: torch.device, dtype: torch.dtype,
                   kv_slots: int = 0) -> AudioFrontEnd:
    """`kv_slots`: sessions whose audio KV the front end pools (as served: the engine's max_sessions)."""
    torch.manual_seed(0)
    with torch.device(dev):
        enc = WhisperEncoder(cfg).to(dtype).eval()
        proj = AudioProjector(cfg.d_model, llm_hidden).to(dtype).eval()
    with torch.no_grad():
        for name, p in [*enc.named_parameters(), *proj.named_parameters()]:
            p.fill_(1.0) if "norm" in name and name.endswith("weight") else p.normal_(0.0, WEIGHT_STD)
    return AudioFrontEnd(enc, proj, cfg, mel_device=dev, kv_slots=kv_slots)


def _pcm(unit: int, n: int, dev: torch.device) -> list[torch.Tensor]:
    cfg = StreamConfig()
    samples = cfg.first_chunk_samples - cfg.prefix_zeros if unit == 0 else cfg.chunk_samples
    return [torch.randn(samples, device=dev) * PCM_STD for _ in range(n)]


def _unit_pcms(units: list[int], dev: torch.device) -> list[torch.Tensor]:
    """One PCM per session, each for that session's own unit index."""
    return [_pcm(u, 1, dev)[0] for u in units]


SDPA = {  # --sdpa: which scaled_dot_product_attention kernels the encoder may use (None: PyTorch's choice)
    "default": None,
    "no-cudnn": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "efficient": ("EFFICIENT_ATTENTION", "MATH"),
    "math": ("MATH",),
}


def _sdpa(name: str) -> contextlib.AbstractContextManager:
    if SDPA[name] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, b) for b in SDPA[name]])


def bench_frontend(fe: AudioFrontEnd, n: int, start_unit: int, iters: int, dev: torch.device,
                   stagger: int = 1, sdpa: str = "default") -> dict:
    """Median / p99 ms of one `encode_units` call for `n` sessions, and what the timed units covered.

    stagger K: session i starts K - 1 - (i % K) units later than session 0, so the sessions' audio caches differ
    in length as in serving (the encoder then attends under a padding mask); 1 = all at the same unit."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    states = [fe.new_session() for _ in range(n)]
    done, targets = [0] * n, [start_unit - (i % stagger) for i in range(n)]
    with _sdpa(sdpa):
        while any(d < t for d, t in zip(done, targets, strict=True)):
            idx = [i for i in range(n) if done[i] < targets[i]]
            fe.encode_units([states[i] for i in idx], _unit_pcms([done[i] for i in idx], dev))
            for i in idx:
                done[i] += 1
        samples, slides, resets = [], 0, 0
        for k in range(iters):
            pcm = _unit_pcms([d + k for d in done], dev)  # made before the clock starts: already on the device
            base, reset_count = states[0].mel.base_sample, states[0].kv.resets
            sync()
            t0 = time.perf_counter()
            fe.encode_units(states, pcm)
            sync()
            samples.append((time.perf_counter() - t0) * 1e3)
            slides += states[0].mel.base_sample != base
            resets += states[0].kv.resets != reset_count
    samples.sort()
    median = samples[len(samples) // 2]
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return dict(name="front end: log-mel + Whisper + projector", batch=n, ctx=start_unit, ms=(median, p99),
                units=f"{start_unit}..{start_unit + iters - 1}", slides=slides, resets=resets, stagger=stagger,
                sdpa=sdpa)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32,64", help="sessions' units per call")
    ap.add_argument("--start-unit", type=int, default=24)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--stagger", default="1", help="comma list: sessions spread over K units (padding mask)")
    ap.add_argument("--sdpa", default="default", help=f"comma list of SDPA kernel sets: {', '.join(SDPA)}")
    ap.add_argument("--graphs", default="on", help="comma list: on (the encoder's captured steps, as served on a "
                    "GPU; on the CPU their eager replay), off (eager layers)")
    ap.add_argument("--tiny", action="store_true", help="tiny encoder on the CPU (smoke test)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batches = [int(n) for n in args.batches.split(",")]
    fe = build_frontend(TINY_AUDIO if args.tiny else FULL_AUDIO, 128 if args.tiny else 4096, dev, dtype,
                        kv_slots=max(batches))  # one row's sessions are dropped before the next row's start
    modes = args.graphs.split(",")
    graphs = None
    if "on" in modes:
        t0 = time.perf_counter()
        fe.capture_graphs(eager_replay=dev.type != "cuda")
        graphs = fe.graphs
        print(f"encoder graphs: {len(graphs.keys())} captured in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for mode in modes:
        fe.graphs = graphs if mode == "on" else None
        rows += [bench_frontend(fe, int(n), args.start_unit, args.iters, dev, int(k), sdpa) | {"graphs": mode}
                 for sdpa in args.sdpa.split(",") for k in args.stagger.split(",") for n in batches]
    print(f"{'sessions':>8s} {'stagger':>7s} {'sdpa':>9s} {'graphs':>6s} {'median ms':>10s} {'p99 ms':>8s}  "
          "units timed (slides, KV resets)")
    for r in rows:
        print(f"{r['batch']:8d} {r['stagger']:7d} {r['sdpa']:>9s} {r['graphs']:>6s} {r['ms'][0]:10.2f} "
              f"{r['ms'][1]:8.2f}  {r['units']} ({r['slides']}, {r['resets']})")
    if args.json:
        device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
