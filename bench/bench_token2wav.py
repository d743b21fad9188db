"""Token2Wav chunk benchmark (targets.md P5): one 25-code chunk (28 with look-ahead) → 24 kHz PCM16.

Full-size flow (§1.6) and HiFT (§1.7) with seeded random weights, a 10 s voice prompt (P = 500),
5 Euler steps; batch 1 / 8 / 32; eager vs CUDA graphs; beside the Step-Audio2 reference chunk call
(`Token2wav.stream` body, batch 1) in the same process. CUDA events, median / p99.
Also times the turn-start first call with and without the `first_hop` option, and the slot-pool
path (`run_flow_pooled`): `pool_b{B}` = the same uniform batch as `ours_*`, `ragged_b{B}` = rows with
mixed prompt lengths (P = 0.5x / 1x / 1.5x the prompt), mixed code counts (28, 15, 8, last 3) and
mixed cache lengths (rows 0, 1, 3 calls into their turn). `--tiny`: CPU smoke run at tiny dims.

    python bench/bench_token2wav.py [--tiny] [--iters 30] [--batches 1,8,32] [--out result.json]

`--warm-up 32` instead builds the engine as the Triton bridge does for max_sessions = 32 (slot pool,
row buckets, graph cap) with one voice of the prompt size, runs `Token2WavEngine.warm_up` and reports
the graphs it built (per kind and row count), the seconds, the device memory after building the pool and
after warm-up (`mem_get_info`, allocator allocated / reserved / peak) and the big buffers' bytes; then one
turn of every batch size 1..32 must find its graphs (`misses` stays empty). One size per process gives
clean device figures:

    python bench/bench_token2wav.py --flow-dtype fp16 --warm-up 32 --out warm32.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.stage1.token2wav_engine import WARMUP_UNITS, Token2WavEngine, Token2WavEngineConfig  # noqa: E402
from engine.stage1.types import Fence  # noqa: E402
from engine.token2wav.assets import TINY_HIFT, Token2WavModels  # noqa: E402
from engine.token2wav.batch import group_by, hift_bucket_key  # noqa: E402
from engine.token2wav.buckets import row_buckets  # noqa: E402
from engine.token2wav.config import TINY_FLOW, FlowConfig, HiFTConfig, StreamConfig  # noqa: E402
from engine.token2wav.flow import Flow  # noqa: E402
from engine.token2wav.graphs import GraphCache  # noqa: E402
from engine.token2wav.hift import HiFT  # noqa: E402
from engine.token2wav.pool import FlowPool, PoolConfig  # noqa: E402
from engine.token2wav.pooled import run_flow_pooled  # noqa: E402
from engine.token2wav.ragged_graphs import RaggedSolver  # noqa: E402
from engine.token2wav.stream import PendingCall, new_session, run_flow_batch  # noqa: E402
from engine.token2wav.voice import VoicePack, build_voice_cache  # noqa: E402
from engine.weights import init_module_  # noqa: E402


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, iters: int, setup=None, warmup: int = 2) -> list[float]:
        out = []
        for i in range(warmup + iters):
            if setup is not None:
                setup()
            if self.cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                out.append(ms)
        return out


def stats(ms: list[float]) -> dict:
    return {"median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms)}


def build_models(tiny: bool, device: torch.device, flow_dtype: torch.dtype = torch.float32) -> Token2WavModels:
    fcfg, hcfg = (TINY_FLOW, TINY_HIFT) if tiny else (FlowConfig(), HiFTConfig())
    gen = torch.Generator().manual_seed(0)
    flow, hift = Flow(fcfg), HiFT(hcfg)
    init_module_(flow, gen)
    init_module_(hift, gen)
    return Token2WavModels(flow.to(device, flow_dtype).eval(), hift.to(device).eval(), fcfg, hcfg, "A")


def make_voice(p_tok: int, vocab: int, seed: int = 1) -> VoicePack:
    g = torch.Generator().manual_seed(seed)
    return VoicePack(torch.randint(0, vocab, (p_tok,), generator=g, dtype=torch.int32),
                     torch.randn(192, generator=g), torch.randn(2 * p_tok, 80, generator=g))


def bench_ours(models, vc, scfg, batch: int, graphs: GraphCache, timer: Timer, iters: int, n_tok: int) -> dict:
    sessions = [new_session(models, vc, scfg, seed=i) for i in range(batch)]
    g = torch.Generator().manual_seed(2)
    toks = [torch.randint(0, models.flow_cfg.vocab_size, (n_tok,), generator=g).tolist() for _ in range(batch)]

    def reset() -> None:
        for s in sessions:
            s.reset_exec()

    def chunk() -> None:
        calls = [PendingCall(t, False) for t in toks]
        run_flow_batch(models, sessions, calls, graphs.estimator, graphs.encoder)
        ins = [s.hift_inputs(c) for s, c in zip(sessions, calls, strict=True)]
        mel, src, ini, noise = (torch.cat([x[k] for x in ins], dim=0) for k in range(4))
        speech, source = graphs.vocoder(mel, src, ini, noise)
        for i, (s, c) in enumerate(zip(sessions, calls, strict=True)):
            s.finish_phase(c, ins[i][0], speech[i:i + 1], source[i:i + 1])   # includes the D2H copy

    with torch.inference_mode():
        result = stats(timer(chunk, iters, setup=reset))
        maybe_profile(chunk, reset)
        return result


def maybe_profile(chunk, reset) -> None:
    """With --profile: one more (untimed) call under torch.profiler, its top ops printed."""
    if not PROFILE.get("on"):
        return
    reset()
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        chunk()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


PROFILE: dict[str, bool] = {}
RAGGED_CODES = (28, 15, 28, 8, 3)     # row i: RAGGED_CODES[i % 5] codes; 3 = a last call
RAGGED_STAGE = (0, 1, 3)              # row i has run RAGGED_STAGE[i % 3] calls of its turn already


def bench_pooled(models, vcs, scfg, batch: int, graphs: GraphCache, timer: Timer, iters: int, ragged: bool) -> dict:
    """One engine step over the slot pool: ragged flow batch → HiFT per mel length → finish.
    In graph mode the estimator solve replays from `RaggedSolver` graphs as well."""
    cfg = models.flow_cfg
    solver = RaggedSolver(models.flow.decoder.estimator, graphs.enabled)
    pool = FlowPool(cfg, scfg, PoolConfig(slots=batch, max_prompt_frames=max(v.prompt_frames for v in vcs)),
                    models.flow.spk_embed_affine_layer.weight.device, next(models.flow.parameters()).dtype)
    sessions = [new_session(models, vcs[i % len(vcs)] if ragged else vcs[0], scfg, seed=i, slot=pool.acquire())
                for i in range(batch)]
    g = torch.Generator().manual_seed(2)
    n_codes = [RAGGED_CODES[i % len(RAGGED_CODES)] if ragged else 28 for i in range(batch)]
    toks = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in n_codes]
    stage = [RAGGED_STAGE[i % len(RAGGED_STAGE)] if ragged else 0 for i in range(batch)]

    def reset() -> None:
        for s in sessions:
            s.reset_exec()
        for k in range(max(stage)):     # untimed: bring rows to different cache lengths
            rows = [i for i in range(batch) if stage[i] > k]
            run_flow_pooled(models, pool, [sessions[i] for i in rows], [PendingCall(toks[0], False) for _ in rows],
                            solver)

    def chunk() -> None:
        calls = [PendingCall(t, n == 3) for t, n in zip(toks, n_codes, strict=True)]
        run_flow_pooled(models, pool, sessions, calls, solver)
        ins = [s.hift_inputs(c) for s, c in zip(sessions, calls, strict=True)]
        for group in group_by([hift_bucket_key(x[0].shape[2], x[1].shape[2]) for x in ins]):
            mel, src, ini, noise = (torch.cat([ins[i][k] for i in group], dim=0) for k in range(4))
            speech, source = graphs.vocoder(mel, src, ini, noise)
            for row, i in enumerate(group):
                sessions[i].finish_phase(calls[i], ins[i][0], speech[row:row + 1], source[row:row + 1])

    with torch.inference_mode():
        result = stats(timer(chunk, iters, setup=reset))
        maybe_profile(chunk, reset)
        return result


GRAPHS_PER_BUCKET = 10   # as model_repository/common/bridges/token2wav_bridge.py


def _device_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"device_used_gib": (total - free) / 2**30, "allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}


def bench_warm_up(models: Token2WavModels, voice: VoicePack, max_batch: int, device: torch.device) -> dict:
    """The bridge's engine for `max_batch` sessions: warm-up graphs, seconds, memory; then a live turn of
    every batch size 1..max_batch, which must find its graphs."""
    buckets = row_buckets(max_batch)
    cfg = Token2WavEngineConfig(max_batch=max_batch, use_cuda_graphs=device.type == "cuda",
                                pool=PoolConfig(slots=max_batch), max_graphs=GRAPHS_PER_BUCKET * len(buckets))
    before = _device_memory(device)
    eng = Token2WavEngine(models, cfg)
    eng.add_voice("v", voice)
    after_pool = _device_memory(device)
    lines: list[str] = []
    t0 = time.perf_counter()
    eng.warm_up("v", lambda line: (lines.append(line), print(line, flush=True)))
    warm_s = time.perf_counter() - t0
    after = _device_memory(device)
    kinds = {"solve": (eng.solver.graphs, 2), "encode": (eng.solver.enc_graphs, 0),
             "hift": (eng.graphs.hift_graphs, 0)}   # (table, the key entry whose first dim is the row count)
    graphs = {k: sorted({key[i][0] for key in table}) for k, (table, i) in kinds.items()}
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    out = {"max_batch": max_batch, "buckets": list(buckets), "warm_sizes": list(eng.warm_sizes()),
           "graphs": eng.graph_count(), "graphs_by_kind": {k: len(t) for k, (t, _) in kinds.items()},
           "graph_rows_by_kind": graphs, "warm_up_s": warm_s, "memory_before": before,
           "memory_after_pool": after_pool, "memory_after_warm_up": after,
           "pool_gib": nbytes(eng.pool.tensors()) / 2**30 if eng.pool is not None else 0,
           "static_io_gib": (eng.solver.io.nbytes() + eng.graphs.io.nbytes()) / 2**30, "progress": lines}
    fence, rng = Fence(1, 0), np.random.default_rng(5)
    t0 = time.perf_counter()
    for n in range(1, max_batch + 1):
        sids = [f"live{i}" for i in range(n)]
        for i, sid in enumerate(sids):
            eng.open(sid, fence, "v", seed=i)
        for unit in range(WARMUP_UNITS):
            for sid in sids:
                eng.submit(sid, fence, unit, rng.integers(0, models.flow_cfg.vocab_size, 25).tolist(),
                           end_of_turn=unit == WARMUP_UNITS - 1)
        while eng.pending():
            eng.step()
        for sid in sids:
            eng.close(sid, fence)
    out["live_turns_s"], out["misses_after_live_turns"] = time.perf_counter() - t0, eng.misses.counts()
    out["memory_after_live_turns"] = _device_memory(device)
    return out


def fp16_accuracy(tiny: bool, device: torch.device, p_tok: int, scfg: StreamConfig, calls: int = 3) -> dict:
    """Mel and PCM of `calls` stream calls with the fp16 flow against the fp32 flow (same seeded
    weights, voice and codes; HiFT fp32 in both): what the fp16 option costs in accuracy."""
    mels, pcms = [], []
    for dtype in (torch.float32, torch.float16):
        models = build_models(tiny, device, dtype)
        vc = build_voice_cache(models.flow, make_voice(p_tok, models.flow_cfg.vocab_size), scfg)
        session = new_session(models, vc, scfg, seed=0)
        g = torch.Generator().manual_seed(3)
        mel, pcm = [], []
        with torch.inference_mode():
            for _ in range(calls):
                call = PendingCall(torch.randint(0, models.flow_cfg.vocab_size, (28,), generator=g).tolist(), False)
                run_flow_batch(models, [session], [call])
                ins = session.hift_inputs(call)
                speech, source = models.hift(*ins)
                mel.append(call.mel.float().cpu())
                pcm.append(session.finish_phase(call, ins[0], speech, source).astype(np.float64))
        mels.append(torch.cat(mel, dim=2).double().numpy())
        pcms.append(np.concatenate(pcm))
        del models, vc, session

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(b - a) / max(float(np.linalg.norm(a)), 1e-30))

    return {"mel_rel_l2": rel(*mels), "pcm_rel_l2": rel(*pcms), "pcm_max_abs_lsb": float(np.abs(pcms[1] - pcms[0]).max()),
            "pcm_ref_rms_lsb": float(np.sqrt(np.mean(pcms[0] ** 2)))}


def ref_module(name: str):
    site = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "stepaudio2"
    repo = Path(__file__).resolve().parents[1]
    folder = next((p for p in (Path(sys.prefix) / site, *repo.glob(".venv/lib/python3*/site-packages/stepaudio2"))
                   if p.is_dir()), Path(sys.prefix) / site)
    if "stepaudio2" not in sys.modules:
        pkg = types.ModuleType("stepaudio2")
        pkg.__path__ = [str(folder)]
        sys.modules["stepaudio2"] = pkg
    return importlib.import_module(f"stepaudio2.{name}")


def bench_reference(models, voice, scfg, timer: Timer, iters: int, device: torch.device) -> dict:
    """The reference `Token2wav.stream` body on the stepaudio2 modules (full size only, batch 1)."""
    c = models.flow_cfg
    enc = ref_module("cosyvoice2.transformer.upsample_encoder_v2").UpsampleConformerEncoderV2(
        input_size=c.input_size, output_size=c.enc_dim, pre_lookahead_len=c.pre_lookahead_len,
        num_blocks=c.enc_blocks, num_up_blocks=c.enc_up_blocks, up_stride=c.up_stride,
        attention_heads=c.enc_heads, linear_units=c.enc_linear_units)
    dit = ref_module("cosyvoice2.flow.decoder_dit").DiT(
        in_channels=c.dit_in_channels, out_channels=c.dit_out_channels, mlp_ratio=c.dit_mlp_ratio,
        depth=c.dit_depth, num_heads=c.dit_heads, head_dim=c.dit_head_dim, hidden_size=c.dit_hidden)
    cfm = ref_module("cosyvoice2.flow.flow_matching").CausalConditionalCFM(dit, inference_cfg_rate=c.cfg_rate)
    flow = ref_module("cosyvoice2.flow.flow").CausalMaskedDiffWithXvec(
        input_size=c.input_size, output_size=c.mel_dim, spk_embed_dim=c.spk_embed_dim, vocab_size=c.vocab_size,
        encoder=enc, decoder=cfm)
    flow.load_state_dict(models.flow.state_dict())
    hg = ref_module("flashcosyvoice.modules.hifigan")
    hift = hg.HiFTGenerator()
    from engine.token2wav.assets import hift_file_state
    hift.load_state_dict({k.removeprefix("generator."): v for k, v in hift_file_state(models.hift).items()})
    flow, hift = flow.to(device).eval(), hift.to(device).eval()
    p = voice.prompt_mel.shape[0]
    spk = voice.spk_embedding[None].to(device)
    pad = torch.full((1, 3), scfg.silence_code, dtype=torch.long)
    toks = torch.cat([voice.prompt_tokens[None].long(), pad], dim=1).to(device)
    base = flow.setup_cache(toks, voice.prompt_mel[None].to(device), spk, n_timesteps=scfg.n_timesteps)
    base = {k: v.clone() for k, v in base.items()}
    chunk_toks = torch.randint(0, c.vocab_size, (1, 28), generator=torch.Generator().manual_seed(2)).to(device)
    window = torch.from_numpy(np.hamming(2 * 3840)).to(device)
    state: dict = {}

    def reset() -> None:
        state["cache"] = {k: v.clone() for k, v in base.items()}

    def chunk() -> None:
        mel, cache = flow.inference_chunk(chunk_toks, spk, state["cache"], False, scfg.n_timesteps)
        if cache["estimator_att_cache"].shape[4] > p + 100:
            a = cache["estimator_att_cache"]
            cache["estimator_att_cache"] = torch.cat([a[..., :p, :], a[..., -100:, :]], dim=4)
        speech, source = hift(mel, torch.zeros(1, 1, 0, device=device))
        speech = speech * 1.0
        speech[..., :3840] = speech[..., :3840] * window[:3840] + speech[..., :3840] * window[3840:]
        pcm = (np.clip(speech.cpu().numpy(), -1.0, 1.0) * 32767.0).astype("<i2")
        del pcm, source

    return stats(timer(chunk, iters, setup=reset))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=250)   # 10 s → P = 500 mel frames
    ap.add_argument("--first-hop", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per run")
    ap.add_argument("--flow-dtype", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (changes fp32 numerics)")
    ap.add_argument("--compile-flow", action="store_true",
                    help="the conformer and DiT blocks torch.compile'd (the engine option compile_flow)")
    ap.add_argument("--compile-hift", action="store_true",
                    help="the HiFT's Snake activations torch.compile'd (the engine option compile_hift)")
    ap.add_argument("--warm-up", type=int, default=0, metavar="MAX_SESSIONS",
                    help="only the engine warm-up at this many sessions: graphs, seconds, memory")
    args = ap.parse_args()
    PROFILE["on"] = args.profile
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    iters = min(args.iters, 3) if args.tiny else args.iters
    batches = [1, 2] if args.tiny else [int(b) for b in args.batches.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    flow_dtype = torch.float16 if args.flow_dtype == "fp16" else torch.float32
    models = build_models(args.tiny, device, flow_dtype)
    if args.compile_flow:  # the first call of each shape compiles: the timed runs come after a warm-up
        models.flow.compile_blocks()
    if args.compile_hift:
        models.hift.compile_snakes()
    scfg = StreamConfig()
    voice = make_voice(8 if args.tiny else args.prompt_tokens, models.flow_cfg.vocab_size)
    vc = build_voice_cache(models.flow, voice, scfg)
    p_tok = voice.prompt_tokens.shape[0]
    vcs = [vc] + [build_voice_cache(models.flow, make_voice(max(2, int(p_tok * f)), models.flow_cfg.vocab_size, 1 + j),
                                    scfg) for j, f in enumerate((0.5, 1.5))]
    if args.warm_up:
        del vc, vcs
        results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tiny": args.tiny,
                   "flow_dtype": args.flow_dtype, "prompt_frames": 2 * p_tok,
                   "warm_up": bench_warm_up(models, voice, args.warm_up, device)}
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        print(json.dumps(results))
        return
    timer = Timer(device)
    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "tiny": args.tiny, "prompt_frames": vc.prompt_frames, "n_timesteps": scfg.n_timesteps,
                     "flow_dtype": args.flow_dtype, "tf32": args.tf32, "compile_flow": args.compile_flow,
                     "compile_hift": args.compile_hift}
    for graphs_on in (False, True):
        graphs = GraphCache(models.flow.decoder.estimator, models.hift, graphs_on, encoder=models.flow.encoder)
        mode = "graph" if graphs.enabled else "eager"
        if graphs_on and not graphs.enabled:
            continue
        for b in batches:
            results[f"ours_{mode}_b{b}"] = r = bench_ours(models, vc, scfg, b, graphs, timer, iters, 28)
            print(f"ours {mode:5s} batch {b:2d}: median {r['median_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms", flush=True)
        for b in batches:
            for ragged in (False, True):
                name = f"{'ragged' if ragged else 'pool'}_{mode}_b{b}"
                results[name] = r = bench_pooled(models, vcs, scfg, b, graphs, timer, iters, ragged)
                print(f"{name:18s}: median {r['median_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms", flush=True)
        hop = scfg.prefix_len + args.first_hop
        results[f"first_call_{mode}_hop{args.first_hop}"] = r = bench_ours(models, vc, scfg, 1, graphs, timer, iters, hop)
        print(f"ours {mode:5s} first call, first_hop {args.first_hop} ({hop} codes): "
              f"median {r['median_ms']:.1f} ms (vs 28 codes: {results[f'ours_{mode}_b1']['median_ms']:.1f})")
    if not args.tiny and not args.no_reference and args.flow_dtype == "fp32":
        del vc, vcs
        torch.cuda.empty_cache() if device.type == "cuda" else None
        results["reference_b1"] = r = bench_reference(models, voice, scfg, timer, iters, device)
        print(f"reference batch  1: median {r['median_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms")
    if args.flow_dtype == "fp16":
        del vc, vcs
        results["fp16_vs_fp32"] = r = fp16_accuracy(args.tiny, device, 8 if args.tiny else args.prompt_tokens, scfg)
        print(f"fp16 flow vs fp32, 3 calls: mel rel L2 {r['mel_rel_l2']:.2e}; PCM rel L2 {r['pcm_rel_l2']:.2e}, "
              f"max |diff| {r['pcm_max_abs_lsb']:.0f} LSB (fp32 RMS {r['pcm_ref_rms_lsb']:.0f} LSB)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
