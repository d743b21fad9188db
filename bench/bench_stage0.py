"""Stage0 benchmark (targets.md P1-P3, issues 15 and 16): decode step, unit prefill, sampling and the audio
front end, ours vs HF transformers vs floor, at 2 k and at the serving context (the h200 profile's KV window,
8192 positions).

Full size (model.md §1.2, dummy weights N(0, 0.02), §9.5) on a GPU:
    python bench/bench_stage0.py --batches 1,8,32,64 --json out.json
    python bench/bench_stage0.py --compile max-autotune-no-cudagraphs --engine-batches 1,32 --json out.json
The issue-16 figures for the default serving configuration (compiled graphs, merged unit close), one command
per context (runs at one commit merge into the file; R=bench/results/stage0-h200.json):
    python bench/bench_stage0.py --compile default --batches 1,32 --engine-batches 1,32 --contexts 2048 --results $R
    python bench/bench_stage0.py --compile default --batches 1,32 --engine-batches 1,32 --contexts 8192 --results $R
Sampling alone over the full vocabulary (no model; CPU or GPU): the full-vocabulary sort with the history
copied from the host vs the top-k candidates with the device history ring:
    python bench/bench_stage0.py --sampler-only --sampler-batches 1,32
CPU smoke test on the tiny model (graph sets run in eager replay):
    python bench/bench_stage0.py --tiny
Rows: the model forward eager / in our CUDA graphs (decode and unit prefill, with --compile also compiled; the
graph rows use the engine rows' slot length, span buckets and compile settings, so they replay what the engine's
step replays, and each compiled row compiles from a fresh dynamo state as a serving process does);
the batched audio front end for N sessions' units (log-mel on the device + streaming Whisper + projector,
bench/stage0_frontend.py); then the engine's own `step()` (graphs and compile as configured by
Stage0Config, scripted decisions §9.5, merged unit close) with the real front end: decode steps and unit
steps (N sessions' units = front end + prefill), host work and the id read-back included.
Prints a table last: median and p99 ms per step, beside the bandwidth floor (LLM rows) and HF.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.stage0_frontend import FULL_AUDIO, TINY_AUDIO, bench_frontend, build_frontend
from engine.config import LLMConfig
from engine.hostio import read_back
from engine.model import flex
from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0 import DecodeRules, Fence, SamplingParams, Stage0Config, Stage0Engine
from engine.stage0.frontend import AudioFrontEndAdapter
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, bucket
from engine.stage0.penalty import HistoryRing
from engine.stage0.runner import KV_LIMIT_QUANTUM
from engine.stage0.sampling import TOP_CANDIDATES, SamplerIds, SamplingBatch, sample
from engine.stage0.script import ScriptPlan
from engine.stage0.session import Phase, UnitRecord

FULL = LLMConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=151748, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6)
TINY = LLMConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6)
SERVING_CONTEXT = 8192  # deploy/profiles/h200.yaml kv_window: the benchmark runs where the server runs
CONTEXTS = f"2048,{SERVING_CONTEXT}"  # issue 16: every figure at 2 k and at the serving context
# `--results` rows (issue 16's format): `what` -> the row of the default serving configuration
RESULT_ROWS = {"forward_decode": "graph decode [{attention}]{mode}",
               "forward_prefill": "graph prefill 13 [{prefill}]{mode}",
               "engine_decode": "engine step decode{mode}", "engine_prefill": "engine step prefill{mode}"}
UNIT_PREFILL = 11  # `<unit>` + 10 audio embeddings
MERGED_PREFILL = 13  # the previous unit's `[terminator, </unit>]` + the above (model.md §3.6)
FRAME_PREFILL = MERGED_PREFILL + 66  # the same with one camera frame (`<image>` + 64 embeddings + `</image>`)
WEIGHT_STD = 0.02  # model.md §9.4 / §9.5
BYTE_IDS = 256  # the bench tokenizer: one id per byte, the special tokens at the top of the vocabulary
SPECIALS = ("<|im_start|> <|im_end|> <unit> </unit> <|audio_start|> <|audio_end|> <image> </image> <|listen|> "
            "<|speak|> <|tts_bos|> <|chunk_eos|> <|chunk_tts_eos|> <|turn_eos|> <|tts_pad|>").split()


def dummy_init(model: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, WEIGHT_STD)


def timed(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """Median and p99 wall ms of fn(), synchronising around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return stats(samples)


def stats(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def floor_ms(cfg: LLMConfig, n_params: int, elem: int, kv_positions: int, bw: float) -> float:
    kv_bytes = kv_positions * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
    return (n_params * elem + kv_bytes) / bw * 1e3


def quantized(n: int) -> int:
    return -(-n // KV_LIMIT_QUANTUM) * KV_LIMIT_QUANTUM


def random_kv(cfg: LLMConfig, slots: int, max_len: int, dev: torch.device, dtype: torch.dtype) -> SlotKVCache:
    kv = SlotKVCache.allocate(cfg, slots, max_len, dtype=dtype, device=dev)
    for t in (*kv.k, *kv.v):
        t.normal_()  # never time on zeros
    return kv


def graph_modes(args: argparse.Namespace) -> list[str | None]:
    return [] if args.no_graphs else [None] + ([args.compile] if args.compile else [])


# what engine_config reads beyond `context`, with the values a script that has no option for one takes
ENGINE_DEFAULTS = dict(engine_units=5, slot_len=None, no_graphs=False, compile=None, compile_static=False,
                       no_fuse=False, prefill_attention=["gather"], decode_attention=["matmul"], slots=0, profile=None)


def engine_args(args: argparse.Namespace, **given: object) -> argparse.Namespace:
    """`args` completed with what engine_config reads: `given` wins, then what `args` has, then ENGINE_DEFAULTS
    (the flex splits: the model's class defaults). One place, so a new engine option cannot leave a caller's
    hand-filled namespace behind (stop 42's CI broke that way)."""
    defaults = dict(ENGINE_DEFAULTS, flex_keys_per_split=Qwen3LLM.flex_keys_per_split,
                    flex_prefill_keys_per_split=Qwen3LLM.flex_prefill_keys_per_split)
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    for name, value in given.items():
        setattr(args, name, value)
    return args


def engine_config(b: int, args: argparse.Namespace, dev: torch.device) -> tuple[Stage0Config, DecodeRules]:
    """The engine rows' configuration for b sessions at `args.context`; the graph rows build their KV, span
    buckets and compile mode from it too, so a graph row replays what the engine's step replays (same slot
    length, hence the same attention span `kv.reserved_pos`, same batch bucket, same compile)."""
    rules = DecodeRules(force_listen_count=0)
    # KV room for the timed units, the warm-up unit and the engine's two-unit admission margin
    room = (args.engine_units + 3) * Stage0Config(max_frames_per_unit=0).unit_max_positions(rules)
    max_context = args.context + room if args.slot_len is None else args.slot_len - 1
    if max_context < args.context + room:
        raise SystemExit(f"--slot-len {args.slot_len} holds no {args.engine_units} units after {args.context} "
                         f"positions (needs {args.context + room + 1}; fewer --engine-units or a shorter context)")
    config = Stage0Config(
        max_sessions=max(b, args.slots), eviction="off", max_context=max_context, max_frames_per_unit=0,
        span_align=1 if args.slot_len is not None else Stage0Config.span_align,  # --slot-len is taken as is
        decode_batch_buckets=(b,), decode_kv_buckets=(quantized(max_context),),
        prefill_batch_buckets=(b,), use_cuda_graphs=not args.no_graphs,
        eager_replay_graphs=dev.type != "cuda" and not args.no_graphs, compile_mode=args.compile,
        compile_dynamic=False if args.compile_static else None,
        fuse_projections=not args.no_fuse, merge_unit_close=True, scripted_decisions=True, benchmark_mode=True,
        prefill_attention=args.prefill_attention[0], decode_attention=args.decode_attention[0],
        flex_keys_per_split=args.flex_keys_per_split, flex_prefill_keys_per_split=args.flex_prefill_keys_per_split,
        # all speak units, so every session decodes in lock step (turn-end every `speak_units`)
        script_plan=ScriptPlan(listen_units=0, tail_listen_units=0))
    return config, rules


def served_kernels(config: Stage0Config, profile: str | None) -> Stage0Config:
    """`config` with the kernel options of a deploy profile's stage0 engine options, mapped as the stage0 bridge
    maps them (compile, attention, GEMM rows and tiles, mixed steps, shared buckets), so the engine rows time
    what that profile serves; None: `config` as it is."""
    return config if profile is None else dataclasses.replace(config, **profile_kernels(profile))


def profile_kernels(profile: str) -> dict:
    """The Stage0Config keywords of a deploy profile's stage0 kernel options (the profile checked on load)."""
    # by its directory, as bench_stage_memory does: a host with pypa's `build` installed shadows `build.` (the H100's)
    build_dir = str(Path(__file__).resolve().parents[1] / "build")
    if build_dir not in sys.path:
        sys.path.insert(0, build_dir)
    from make_model_repository import DeployProfile

    from model_repository.common.bridges.stage0_bridge import kernel_options

    return kernel_options(DeployProfile.load(Path(profile)).engine_options.get("stage0", {}))


def graph_flex_options(args: argparse.Namespace) -> dict[str, int]:
    """The flex kernel options of the graph rows (`Qwen3LLM` attributes): the command's splits, where --profile sets
    one the profile's, and the profile's unit-kernel warps and stages (0 = torch's without one), so the graph rows
    run the attention the engine rows and the served profile do."""
    options = dict(flex_keys_per_split=args.flex_keys_per_split,
                   flex_prefill_keys_per_split=args.flex_prefill_keys_per_split, flex_prefill_warps=0,
                   flex_prefill_stages=0)
    if args.profile:
        served = profile_kernels(args.profile)
        options.update({name: served[name] for name in options if name in served})
    return options


def fresh_compile(mode: str | None) -> None:
    """Forget earlier compiles of the decoder layer before a compiled graph set or engine is built, so each row
    compiles as a fresh serving process does. NOTE: dynamo keeps per-code-object state: after another row's
    compiles of `run_layer`, a compile_dynamic=None compile is symbolic at once (automatic dynamic) where a
    fresh process compiles its first shape static, so without this a row's kernels depended on the rows
    before it."""
    if mode is not None:
        torch._dynamo.reset()


def bench_decode(model: Qwen3LLM, cfg: LLMConfig, b: int, args: argparse.Namespace, dev: torch.device,
                 dtype: torch.dtype) -> list[dict]:
    config, rules = engine_config(b, args, dev)
    kv = random_kv(cfg, config.max_sessions, config.slot_len(rules), dev, dtype)  # the engine rows' slots, length
    x = torch.randn(b, 1, cfg.hidden_size, dtype=dtype, device=dev)
    pos = torch.full((b, 1), args.context, device=dev)
    slots = torch.arange(b)  # dense layout, as the engine's decode rows: row i = slot i
    span = min(kv.max_len, quantized(args.context + 1))  # the engine's eager span (ModelRunner._limit)
    out = []
    pos_host = pos[:, 0].cpu()
    with torch.no_grad():
        for attention in args.decode_attention:  # the first one stays set for the rows after this
            Qwen3LLM.decode_attention = attention
            eager = timed(lambda: model.logits(model(x, pos, None, kv, kv_limit=span)[:, -1]),
                          args.iters, args.warmup, dev)
            out.append(dict(name=f"model eager decode [{attention}]", batch=b, ctx=args.context, ms=eager,
                            span=span))
            for mode in graph_modes(args):
                fresh_compile(mode)
                graphs = DecodeGraphs.create(model, kv, config.decode_batch_buckets, config.decode_kv_buckets,
                                             compile_mode=mode, eager_replay=dev.type != "cuda",
                                             compile_dynamic=config.compile_dynamic)
                assert graphs is not None
                ms = timed(lambda g=graphs: model.logits(g.run(x[:, 0], pos_host, slots, args.context + 1)),
                           args.iters, args.warmup, dev)
                name = f"graph decode [{attention}]" + (f" +{mode}" if mode else "")
                out.append(dict(name=name, batch=b, ctx=args.context, ms=ms, span=decode_span(graphs, args)))
        Qwen3LLM.decode_attention = args.decode_attention[0]
    return out


def decode_span(graphs: DecodeGraphs, args: argparse.Namespace) -> int:
    """The attention span a decode step at `args.context` replays (the bucket of its reach)."""
    return bucket(args.context + 1, graphs.kv_buckets)


def bench_prefill(model: Qwen3LLM, cfg: LLMConfig, args: argparse.Namespace, dev: torch.device,
                  dtype: torch.dtype) -> list[dict]:
    ctx = args.prefill_context
    config, rules = engine_config(1, args, dev)
    extra = args.extra + (FRAME_PREFILL if args.frame_prefill else 0)
    kv = random_kv(cfg, config.max_sessions, max(config.slot_len(rules), ctx + extra), dev, dtype)
    span = min(kv.max_len, quantized(ctx + MERGED_PREFILL))
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    out, lengths = [], (UNIT_PREFILL, MERGED_PREFILL) + ((FRAME_PREFILL,) if args.frame_prefill else ())
    with torch.no_grad():
        for n in (UNIT_PREFILL, MERGED_PREFILL):  # eager rows: the audio units only
            x = torch.randn(n, cfg.hidden_size, dtype=dtype, device=dev)
            pos = torch.arange(ctx, ctx + n, device=dev)[None]
            ms = timed(lambda x=x, pos=pos: model.logits(model(x[None], pos, slot, kv, kv_limit=span)[:, -1]),
                       args.iters, args.warmup, dev)
            out.append(dict(name=f"model eager prefill {n}", batch=1, ctx=ctx, ms=ms, span=span))
        for mode in graph_modes(args):
            for attention in args.prefill_attention:
                fresh_compile(mode)
                graphs = PrefillGraphs.create(model, kv, (1,), lengths,
                                              config.decode_kv_buckets, compile_mode=mode,
                                              eager_replay=dev.type != "cuda", compile_dynamic=config.compile_dynamic,
                                              flex=attention == "flex")
                assert graphs is not None
                for n in lengths:
                    x = torch.randn(n, cfg.hidden_size, dtype=dtype, device=dev)
                    ms = timed(lambda g=graphs, x=x: model.logits(g.run([0], [ctx], [x])[0][-1:]),
                               args.iters, args.warmup, dev)
                    out.append(dict(name=prefill_row_name(n, attention, mode), batch=1, ctx=ctx, ms=ms,
                                    span=bucket(ctx + n, graphs.kv_buckets)))
    out += bench_prefill_batched(model, cfg, args, dev, dtype)
    return out


def prefill_row_name(n: int, attention: str, mode: str | None) -> str:
    return f"graph prefill {n} [{attention}]" + (f" +{mode}" if mode else "")


def bench_prefill_batched(model: Qwen3LLM, cfg: LLMConfig, args: argparse.Namespace, dev: torch.device,
                          dtype: torch.dtype) -> list[dict]:
    """Merged unit prefills of b sessions in one graph, each onto `--prefill-context` retained positions of its
    own slot (the served step's prefill rows; the gather layout copies each row's span, flex reads it)."""
    ctx, out = args.prefill_context, []
    for b in args.prefill_batches:
        config, rules = engine_config(b, args, dev)
        kv = random_kv(cfg, config.max_sessions, max(config.slot_len(rules), ctx + args.extra), dev, dtype)
        xs = [torch.randn(MERGED_PREFILL, cfg.hidden_size, dtype=dtype, device=dev) for _ in range(b)]
        with torch.no_grad():
            for mode in graph_modes(args)[-1:]:  # the served mode only
                for attention in args.prefill_attention:
                    fresh_compile(mode)
                    graphs = PrefillGraphs.create(model, kv, (b,), (MERGED_PREFILL,), config.decode_kv_buckets,
                                                  compile_mode=mode, eager_replay=dev.type != "cuda",
                                                  compile_dynamic=config.compile_dynamic, flex=attention == "flex")
                    assert graphs is not None
                    ms = timed(lambda g=graphs, b=b, xs=xs: g.run(list(range(b)), [ctx] * b, xs), args.iters, args.warmup,
                               dev)
                    out.append(dict(name=prefill_row_name(MERGED_PREFILL, attention, mode), batch=b, ctx=ctx, ms=ms,
                                    span=bucket(ctx + MERGED_PREFILL, graphs.kv_buckets)))
        del kv
    return out


class BenchTokenizer:
    """`TextTokenizer` over bytes: ids 0..255 are bytes, the special tokens sit at the top of the vocabulary, every
    id between decodes to a word (as the served full-size checkpoint's filler tokenizer does,
    build/make_full_checkpoint.py). NOTE: when those ids decoded to "" the §9.5 script's draw of text ids rejected
    ~600 ids per text id, 70-105 ms of host work in every 32-session unit step that served runs never pay."""

    def __init__(self, vocab: int) -> None:
        self._special = {tok: vocab - 1 - i for i, tok in enumerate(SPECIALS)}
        self._text = {v: k for k, v in self._special.items()}

    def encode(self, text: str) -> list[int]:
        ids, rest = [], text
        while rest:
            hit = next((t for t in self._special if rest.startswith(t)), None)
            ids += [self._special[hit]] if hit else list(rest[0].encode())
            rest = rest[len(hit) if hit else 1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        data = b"".join(bytes([i]) if i < BYTE_IDS else b"" if i in self._text else b" w%d" % i for i in ids)
        return data.decode(errors="replace")

    def token_id(self, token: str) -> int:
        return self._special[token]

    @property
    def bad_token_ids(self) -> tuple[int, ...]:
        return ()


class BenchFrontEnd:
    """Random unit embeddings on the device (the audio encoder is benchmarked elsewhere)."""

    def __init__(self, cfg: LLMConfig, per_unit: int, dev: torch.device, dtype: torch.dtype) -> None:
        self.shape, self.dev, self.dtype = (per_unit, cfg.hidden_size), dev, dtype

    def new_state(self) -> None:
        return None

    def encode_unit(self, state: None, pcm: torch.Tensor, unit_index: int) -> torch.Tensor:
        return torch.randn(self.shape, device=self.dev, dtype=self.dtype) * WEIGHT_STD

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def bench_engine(model: Qwen3LLM, cfg: LLMConfig, b: int, args: argparse.Namespace, dev: torch.device,
                 dtype: torch.dtype) -> list[dict]:
    """The engine's own step(): b sessions at `context` retained positions, every unit a scripted speak unit."""
    engine, sids, config = engine_at_context(model, cfg, b, args, dev, dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kinds: dict[str, list[float]] = {"decode": [], "prefill": []}
    for unit, kind in unit_steps(engine, sids, config, args.engine_units):
        sync()
        t0 = time.perf_counter()
        busy = engine.step()
        sync()
        if busy and unit and kind:
            kinds[kind].append((time.perf_counter() - t0) * 1e3)
    span = decode_span(engine.runner.graphs, args) if engine.runner.graphs is not None else None
    return [dict(name=f"engine step {k}" + (f" +{args.compile}" if args.compile else ""), batch=b, ctx=args.context,
                 ms=stats(v), span=span if k == "decode" else None) for k, v in kinds.items() if v]


def engine_at_context(model: Qwen3LLM, cfg: LLMConfig, b: int, args: argparse.Namespace, dev: torch.device,
                      dtype: torch.dtype) -> tuple[Stage0Engine, list[str], Stage0Config]:
    """The engine rows' engine: b sessions opened, prefixes run, each with `args.context` retained positions."""
    config, rules = engine_config(b, args, dev)
    config = served_kernels(config, args.profile)
    fresh_compile(config.compile_mode)
    tok = BenchTokenizer(cfg.vocab_size)
    front: object = BenchFrontEnd(cfg, config.audio_embeddings_per_unit, dev, dtype)
    if not args.no_engine_frontend:  # the real batched front end: a unit step is front end + prefill
        audio_cfg = TINY_AUDIO if args.tiny else FULL_AUDIO
        audio = build_frontend(audio_cfg, cfg.hidden_size, dev, dtype, kv_slots=b)  # as served
        if config.use_cuda_graphs:  # as the stage0 bridge's warm-up does: the encoder's layers in CUDA graphs
            audio.capture_graphs(eager_replay=config.eager_replay_graphs)
        front = AudioFrontEndAdapter(audio)
    engine = Stage0Engine(model, tok, front, lambda event: None, config, rules)
    sids = [f"s{i}" for i in range(b)]
    for i, sid in enumerate(sids):
        engine.open(sid, Fence(1, 0), params=SamplingParams(seed=i))
    engine.run_until_idle()  # system prefixes
    kv = engine.runner.kv
    for sid in sids:  # pretend `context` positions are retained: random KV, one ledger entry
        s = engine.session(sid)
        for t in (*kv.k, *kv.v):
            t[s.slot, :, s.cached_len:args.context].normal_()
        s.ledger.append(UnitRecord(-1, args.context - s.prefix_len, (), "", True))
        s.cached_len = args.context
    return engine, sids, config


def unit_steps(engine: Stage0Engine, sids: list[str], config: Stage0Config,
               units: int) -> Iterator[tuple[int, str | None]]:
    """Appends unit 0 (the warm-up) .. `units` to every session; before each step the caller takes, yields
    (unit, the step's kind: "decode" when every session feeds a token, "prefill" when units start, else None)."""
    for unit in range(units + 1):
        for sid in sids:
            samples = config.first_unit_samples if unit == 0 else config.unit_samples
            engine.append(sid, Fence(1, 0, seq=unit), torch.zeros(samples))
        while engine.has_work():
            phases = {engine.session(sid).phase for sid in sids}
            yield unit, "decode" if phases == {Phase.FEED} else "prefill" if Phase.IDLE in phases else None


class RingOwner:
    """Stands for a session in the history ring, which holds its rows' owners weakly (a bare object() cannot be)."""


def bench_sampler(vocab: int, b: int, args: argparse.Namespace, dev: torch.device) -> list[dict]:
    """One step's sampling of b rows (Step A, B1-B6, the read-back), each row with a full 512-id history:
    the full-vocabulary sort with the history sent from the host vs the candidates with the device ring."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(b, vocab, generator=g) * 3).to(dev, torch.bfloat16 if dev.type == "cuda" else None)
    top = vocab - len(SPECIALS)
    ids = SamplerIds(chunk_eos=top, turn_eos=top + 1, listen_bias=top + 2, masked=(top + 3, top))
    params = [SamplingParams(seed=i) for i in range(b)]
    histories = [torch.randint(0, vocab, (params[0].repetition_window,), generator=g).tolist() for _ in range(b)]
    uniforms = [[0.5, 0.5]] * b
    ring = HistoryRing(b, params[0].repetition_window, vocab, dev)
    owners = [RingOwner() for _ in range(b)]  # alive for the whole run: the ring holds its owners weakly
    ring.sync([(i, owners[i], h, params[0].repetition_window) for i, h in enumerate(histories)])

    def full() -> None:
        batch = SamplingBatch.build(params, histories, uniforms, vocab, dev)
        read_back(torch.stack(sample(logits, batch, ids, candidates=None)).long())

    def candidates() -> None:
        batch = SamplingBatch.from_ring(params, uniforms, ring, list(range(b)), dev)
        read_back(torch.stack(sample(logits, batch, ids)).long())

    return [dict(name="sampler full sort + host history", batch=b, ctx=0, ms=timed(full, args.iters, 2, dev)),
            dict(name=f"sampler top-{TOP_CANDIDATES} + device history", batch=b, ctx=0,
                 ms=timed(candidates, args.iters, 2, dev))]


def bench_ours(model: Qwen3LLM, cfg: LLMConfig, args: argparse.Namespace, dev: torch.device,
               dtype: torch.dtype) -> list[dict]:
    """The LLM rows at `args.context` (forward and engine step)."""
    out = [row for b in args.batches for row in bench_decode(model, cfg, b, args, dev, dtype)]
    out += bench_prefill(model, cfg, args, dev, dtype)
    out += [row for b in args.engine_batches for row in bench_engine(model, cfg, b, args, dev, dtype)]
    return out


def bench_once(cfg: LLMConfig, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    """The rows that do not depend on the context: the audio front end and sampling."""
    out = [row for b in args.sampler_batches for row in bench_sampler(cfg.vocab_size, b, args, dev)]
    if args.frontend_batches:
        front = build_frontend(TINY_AUDIO if args.tiny else FULL_AUDIO, cfg.hidden_size, dev, dtype)
        out += [bench_frontend(front, n, args.frontend_start_unit, args.frontend_iters, dev)
                for n in args.frontend_batches]
        del front
    return out


def result_rows(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Issue 16's `rows`: {what, batch, context, median_ms, p99_ms} of the configuration that was run."""
    mode = f" +{args.compile}" if args.compile else ""
    names = {what: name.format(attention=args.decode_attention[0], prefill=args.prefill_attention[0], mode=mode)
             for what, name in RESULT_ROWS.items()}
    return [dict(what=what, batch=r["batch"], context=r["ctx"], median_ms=r["median_ms"], p99_ms=r["p99_ms"])
            for what, name in names.items() for r in rows if r["name"] == name]


def write_results(path: Path, rows: list[dict], device: str) -> None:
    """Issue 16's JSON. Rows of an earlier run at the same commit on the same device are kept unless this run
    measured them again, so the contexts may run as separate commands (each within a time limit)."""
    head = commit()
    old = json.loads(path.read_text()) if path.exists() else {}
    fresh = {(r["what"], r["batch"], r["context"]) for r in rows}
    kept = [r for r in old.get("rows", []) if (old.get("commit"), old.get("device")) == (head, device)
            and (r["what"], r["batch"], r["context"]) not in fresh]
    order = list(RESULT_ROWS)
    rows = sorted(kept + rows, key=lambda r: (order.index(r["what"]), r["context"], r["batch"]))
    path.write_text(json.dumps(dict(commit=head, device=device, rows=rows), indent=2) + "\n")


def commit() -> str:
    """The checkout's commit, `+dirty` when it has uncommitted changes; in a `git archive` snapshot (the device
    runs, bench/h200/README.md) the COMMIT file it carries, not the enclosing checkout's HEAD."""
    repo = Path(__file__).resolve().parents[1]
    if (repo / "COMMIT").is_file():
        return (repo / "COMMIT").read_text().strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def bench_hf(cfg: LLMConfig, state: dict, args: argparse.Namespace, dev: torch.device,
             dtype: torch.dtype) -> list[dict]:
    import transformers

    hf_cfg = transformers.Qwen3Config(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the run dtype: no fp32 copy of 8 B parameters
    try:
        with torch.device(dev):
            ref = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ref.load_state_dict(state, strict=False)
    out = []

    def prefilled(b: int, ctx: int) -> transformers.DynamicCache:
        cache = transformers.DynamicCache(config=hf_cfg)
        for i in range(b):  # one row at a time keeps the prefill's activations small
            c = transformers.DynamicCache(config=hf_cfg)
            ref.model(inputs_embeds=torch.randn(1, ctx, cfg.hidden_size, dtype=dtype, device=dev),
                      past_key_values=c, use_cache=True)
            for layer in range(cfg.num_hidden_layers):
                k, v = c.layers[layer].keys, c.layers[layer].values
                if i == 0:
                    cache.update(k, v, layer)
                else:
                    lay = cache.layers[layer]
                    lay.keys, lay.values = torch.cat([lay.keys, k]), torch.cat([lay.values, v])
        return cache

    with torch.no_grad():
        for b in args.hf_batches:
            cache = prefilled(b, args.context)
            x = torch.randn(b, 1, cfg.hidden_size, dtype=dtype, device=dev)

            def step(x: torch.Tensor = x, cache: transformers.DynamicCache = cache) -> None:
                h = ref.model(inputs_embeds=x, past_key_values=cache, use_cache=True).last_hidden_state
                ref.lm_head(h[:, -1])
                cache.crop(-1)  # drop the timed position again

            out.append(dict(name="HF eager decode", batch=b, ctx=args.context,
                            ms=timed(step, args.hf_iters, 2, dev)))
            del cache
        cache = prefilled(1, args.prefill_context)
        x = torch.randn(1, UNIT_PREFILL, cfg.hidden_size, dtype=dtype, device=dev)

        def unit() -> None:
            h = ref.model(inputs_embeds=x, past_key_values=cache, use_cache=True).last_hidden_state
            ref.lm_head(h[:, -1])
            cache.crop(-UNIT_PREFILL)

        out.append(dict(name="HF eager unit prefill", batch=1, ctx=args.prefill_context,
                        ms=timed(unit, args.hf_iters, 2, dev)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--hf-batches", default="1,8")
    ap.add_argument("--contexts", default=CONTEXTS, help="retained KV positions per session: the LLM rows at each")
    ap.add_argument("--context", type=int, default=None, help="one context instead of --contexts")
    ap.add_argument("--prefill-context", type=int, default=None, help="unit prefill context (default: the context)")
    ap.add_argument("--sampler-batches", default="1,32", help="rows for the sampling rows ('' = none)")
    ap.add_argument("--sampler-only", action="store_true", help="only the sampling rows (no model is built)")
    ap.add_argument("--frontend-batches", default="1,32,64", help="sessions' units per front-end call ('' = none)")
    ap.add_argument("--frontend-start-unit", type=int, default=24, help="units streamed before timing")
    ap.add_argument("--frontend-iters", type=int, default=12, help="timed front-end calls (consecutive units)")
    ap.add_argument("--no-engine-frontend", action="store_true",
                    help="engine rows with random unit embeddings instead of the real audio front end")
    ap.add_argument("--extra", type=int, default=64,
                    help="prefill rows: at least this many KV positions beyond --prefill-context")
    ap.add_argument("--slots", type=int, default=0,
                    help="KV cache slots of every row (a served engine's max_sessions: 32 in the h200 profile); "
                         "default 0: each row's batch. Flex attention runs over every slot, so a row of a few "
                         "sessions in a cache of its own slots understates its served cost")
    ap.add_argument("--slot-len", type=int, default=None,
                    help="KV positions per slot of the graph and engine rows, hence their top attention span "
                         "(slot length - 1); default: what the engine rows need (context + their units' room + 1); "
                         "taken as is (span_align 1); the h200 profile serves 8385 (kv_window 8192 + one unit with two frames, "
                         "rounded up to a multiple of 64, + 1; 8358 before the rounding)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--hf-iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="device bytes/s (H200 measured)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--compile", default=None,
                    help="torch.compile mode for the graphs and the engine (default, max-autotune-no-cudagraphs)")
    ap.add_argument("--engine-batches", default="1,32", help="sessions for the engine step rows ('' = none)")
    ap.add_argument("--engine-units", type=int, default=5, help="timed units per engine run")
    ap.add_argument("--compile-static", action="store_true",
                    help="engine: compile every graph shape separately (Stage0Config.compile_dynamic=False)")
    ap.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up matmuls")
    ap.add_argument("--no-fold", action="store_true", help="SDPA enable_gqa instead of kv-head-major query rows")
    ap.add_argument("--decode-attention", default="matmul,flex",
                    help="decode attention variants for the decode rows; the first one is used elsewhere")
    ap.add_argument("--prefill-attention", default="flex,gather",
                    help="unit prefill attention variants (Stage0Config.prefill_attention); the first one is "
                         "used by the engine rows")
    ap.add_argument("--frame-prefill", action="store_true",
                    help=f"also a unit prefill with one camera frame ({FRAME_PREFILL} positions), batch 1")
    ap.add_argument("--prefill-batches", default="32",
                    help="sessions' merged unit prefills per graph for the batched prefill rows ('' = none)")
    ap.add_argument("--flex-keys-per-split", type=int, default=flex.KEYS_PER_SPLIT,
                    help="the flex decoding kernel's split length for decode rows (Stage0Config.flex_keys_per_split; "
                         "0: torch's)")
    ap.add_argument("--flex-prefill-keys-per-split", type=int, default=flex.KEYS_PER_SPLIT,
                    help="the same for unit prefills (Stage0Config.flex_prefill_keys_per_split)")
    ap.add_argument("--profile", default=None,
                    help="engine rows with the stage0 kernel options of this deploy profile (attention, splits, "
                         "GEMM tiles, mixed steps), as its stage0 bridge builds them; its compile mode and flex "
                         "kernel options (splits it sets, the unit kernel's warps and stages) for every row")
    ap.add_argument("--json", default=None)
    ap.add_argument("--results", default=None,
                    help="write issue 16's JSON (commit, device, rows of what/batch/context/median_ms/p99_ms)")
    args = parse(ap, sys.argv[1:] if argv is None else argv)
    if args.profile:  # the profile's compile mode for every row, so the rows' names say what ran
        args.compile = profile_kernels(args.profile)["compile_mode"]
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = TINY if args.tiny else FULL
    if args.sampler_only:
        report([r for b in args.sampler_batches for r in bench_sampler(cfg.vocab_size, b, args, dev)], None, 0, 0,
               args, dev)
        return
    with torch.device(dev):
        model = Qwen3LLM(cfg).to(dtype).eval()
    dummy_init(model)
    # the graph rows; the engine rows take them from their config
    for name, value in graph_flex_options(args).items():
        setattr(Qwen3LLM, name, value)
    Qwen3LLM.fold_gqa = not args.no_fold
    Qwen3LLM.decode_attention = args.decode_attention[0]
    if not args.no_fuse:
        model.fuse_projections()  # parameters become views of the fused weights: no extra memory
    n_params = sum(p.numel() for p in model.parameters())
    rows = bench_once(cfg, args, dev, dtype)
    for context in args.contexts:
        args.context, args.prefill_context = context, args.prefill_context_arg or context
        rows += bench_ours(model, cfg, args, dev, dtype)
        if not args.no_hf:
            rows += bench_hf(cfg, model.state_dict(), args, dev, dtype)
    report(rows, cfg, n_params, torch.finfo(dtype).bits // 8, args, dev)


def parse(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if "--tiny" in argv:  # smaller defaults; options given on the command line still win
        ap.set_defaults(prefill_batches="4", contexts="64,128", iters=5, hf_iters=3, batches="1,8", hf_batches="1", engine_batches="1,4",
                        engine_units=2, frontend_batches="1,4", frontend_start_unit=2, frontend_iters=2,
                        sampler_batches="1,4")
    args = ap.parse_args(argv)
    ints = lambda text: [int(b) for b in text.split(",") if b]  # noqa: E731 - a local parser
    args.contexts = [args.context] if args.context else ints(args.contexts)
    args.prefill_context_arg = args.prefill_context
    args.batches, args.engine_batches = ints(args.batches), ints(args.engine_batches)
    args.frontend_batches, args.hf_batches = ints(args.frontend_batches), ints(args.hf_batches)
    args.sampler_batches = ints(args.sampler_batches)
    args.decode_attention = args.decode_attention.split(",")
    args.prefill_attention = args.prefill_attention.split(",")
    args.prefill_batches = ints(args.prefill_batches)
    return args


def report(rows: list[dict], cfg: LLMConfig | None, n_params: int, elem: int, args: argparse.Namespace,
           dev: torch.device) -> None:
    """Floors, the JSON files and the table."""
    for r in rows:
        positions = r["batch"] * r["ctx"]
        # the LLM floor says nothing about the encoder or the sampler
        is_llm = cfg is not None and not r["name"].startswith(("front end", "sampler"))
        r["floor_ms"] = floor_ms(cfg, n_params, elem, positions, args.bandwidth) if is_llm else None  # type: ignore[arg-type]
        r["median_ms"], r["p99_ms"] = r.pop("ms")
    device = str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, params=n_params, slots=args.slots, rows=rows), f, indent=2)
    if args.results:
        write_results(Path(args.results), result_rows(rows, args), device)
    print(f"{'what':44s} {'batch':>5s} {'ctx':>6s} {'span':>6s} {'median ms':>10s} {'p99 ms':>8s} {'floor ms':>9s} "
          f"{'x floor':>8s}")
    for r in rows:
        floor = (f"{r['floor_ms']:9.3f} {r['median_ms'] / r['floor_ms']:8.2f}" if r["floor_ms"]
                 else f"{'-':>9s} {'-':>8s}")
        span = r.get("span") or "-"  # the attention span (kv_limit) of the row's forward
        print(f"{r['name']:44s} {r['batch']:5d} {r['ctx']:6d} {span:>6} {r['median_ms']:10.3f} {r['p99_ms']:8.3f} "
              f"{floor}")


if __name__ == "__main__":
    main()
