"""bench/bench_stage0.py --tiny on CPU writes issue 16's results JSON (the H200 run writes the same file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
WHATS = {"forward_decode", "engine_decode", "forward_prefill", "engine_prefill"}


def test_tiny_bench_writes_the_results_json(tmp_path: Path) -> None:
    out = tmp_path / "stage0.json"
    small = ["--batches", "1", "--engine-batches", "1", "--engine-units", "1", "--frontend-batches", "",
             "--sampler-batches", "1", "--iters", "1", "--warmup", "0", "--decode-attention", "sdpa",
             "--prefill-batches", "2", "--prefill-attention", "gather"]
    subprocess.run([sys.executable, str(REPO / "bench" / "bench_stage0.py"), "--tiny", "--no-hf", *small,
                    "--results", str(out)], check=True, cwd=REPO, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert set(data) == {"commit", "device", "rows"} and data["device"] == "cpu" and data["commit"]
    rows = data["rows"]
    assert all(set(r) == {"what", "batch", "context", "median_ms", "p99_ms"} for r in rows)
    # every kind at both contexts (--tiny's stand-ins for 2 k and the serving 8 k), nothing else
    assert {(r["what"], r["context"]) for r in rows} == {(w, c) for w in WHATS for c in (64, 128)}
    assert all(0 < r["median_ms"] <= r["p99_ms"] for r in rows)
    # one session each, and the forward's unit prefill also for 2 sessions' units in one graph
    assert {(r["what"], r["batch"]) for r in rows} == {(w, 1) for w in WHATS} | {("forward_prefill", 2)}


def test_results_of_separate_runs_merge_at_the_same_commit(tmp_path: Path) -> None:
    from bench.bench_stage0 import write_results

    out = tmp_path / "stage0.json"

    def row(what: str, context: int, ms: float) -> dict:
        return dict(what=what, batch=1, context=context, median_ms=ms, p99_ms=ms)

    write_results(out, [row("engine_decode", 8192, 3.0), row("forward_decode", 2048, 1.0)], "gpu")
    write_results(out, [row("forward_decode", 8192, 2.0), row("forward_decode", 2048, 1.5)], "gpu")
    got = [(r["what"], r["context"], r["median_ms"]) for r in json.loads(out.read_text())["rows"]]
    assert got == [("forward_decode", 2048, 1.5), ("forward_decode", 8192, 2.0), ("engine_decode", 8192, 3.0)]
    write_results(out, [row("forward_decode", 2048, 9.0)], "another gpu")  # another device: a fresh file
    assert [r["median_ms"] for r in json.loads(out.read_text())["rows"]] == [9.0]



def test_engine_rows_run_the_audio_encoder_in_graphs_as_served() -> None:
    """The engine rows' unit step holds the batched front end: with the engine's graphs on, its encoder layers
    run from their graphs as the stage0 bridge's warm-up captures them (stop 49: built eager, the front end
    alone took 27 of a 45 ms batch-1 unit step on an H100, which no served step pays)."""
    import argparse

    from bench.bench_stage0 import TINY, dummy_init, engine_args, engine_at_context, unit_steps
    from engine.model.llm import Qwen3LLM

    torch.manual_seed(0)
    model = Qwen3LLM(TINY).eval()
    dummy_init(model)
    args = engine_args(argparse.Namespace(context=64, tiny=True, no_engine_frontend=False, engine_units=1))
    engine, sids, config = engine_at_context(model, TINY, 2, args, torch.device("cpu"), torch.float32)
    graphs = engine.frontend.audio.graphs
    assert graphs is not None and graphs.keys()
    replays = []
    run = graphs.run
    graphs.run = lambda *a, **k: replays.append(a[1].numel()) or run(*a, **k)
    for _unit, _kind in unit_steps(engine, sids, config, 1):
        engine.step()
    assert replays and max(replays) == 2  # both sessions' units in one replay, every unit through the graphs


def test_engine_rows_take_the_kernel_options_a_profile_serves() -> None:
    """--profile: the engine rows' Stage0Config carries the stage0 kernel options of a deploy profile exactly as
    the stage0 bridge maps them (one mapping, `kernel_options`), and keeps the bench's own geometry."""
    import argparse

    from bench.bench_stage0 import engine_args, engine_config, served_kernels

    args = engine_args(argparse.Namespace(context=64, tiny=True, engine_units=1, slots=32))
    plain, _ = engine_config(4, args, torch.device("cpu"))
    served = served_kernels(plain, str(REPO / "deploy" / "profiles" / "h200.yaml"))
    assert (served.decode_attention, served.mixed_step, served.gemm_tile_rows, served.flex_prefill_keys_per_split,
            served.compile_mode, served.merge_unit_close) == ("flex", "shared", 128, 2048, "default", True)
    assert served.shared_decode_buckets == (2, 4, 8, 16, 32)
    assert (served.flex_prefill_warps, served.flex_prefill_stages) == (4, 2)
    assert (plain.flex_prefill_warps, plain.flex_prefill_stages) == (0, 0)
    assert (plain.decode_attention, plain.mixed_step, plain.gemm_tile_rows) != ("flex", "shared", 128)
    assert (served.max_sessions, served.decode_batch_buckets, served.max_context) == (
        plain.max_sessions, plain.decode_batch_buckets, plain.max_context)
    assert served_kernels(plain, None) is plain
