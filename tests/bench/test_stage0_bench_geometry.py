"""bench/bench_stage0.py: the graph decode rows replay what the engine's step replays (issue 16).

The H200 run at d1cf89b read the graph decode row at 2-3x the engine step: the graph rows had their own KV
cache (context + 64 positions, attention span 8255) while the engine rows attended over 8456 positions of
theirs, and the rows were compiled with different dynamo settings. The rows now share the engine rows'
geometry; each row reports the attention span its forward ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "rows.json"
    small = ["--tiny", "--no-hf", "--contexts", "64", "--batches", "1,2", "--engine-batches", "2",
             "--engine-units", "1", "--frontend-batches", "", "--sampler-batches", "", "--iters", "1",
             "--warmup", "0", "--no-engine-frontend", "--json", str(out), *extra]
    subprocess.run([sys.executable, str(REPO / "bench" / "bench_stage0.py"), *small], check=True, cwd=REPO,
                   capture_output=True, timeout=300)
    return json.loads(out.read_text())["rows"]


def spans(rows: list[dict], prefix: str, batch: int) -> set[int]:
    return {r["span"] for r in rows if r["name"].startswith(prefix) and r["batch"] == batch}


def test_graph_decode_rows_attend_over_the_engine_rows_span(tmp_path: Path) -> None:
    rows = run_bench(tmp_path)
    engine = spans(rows, "engine step decode", 2)
    # 64 positions + 4 units' room of 33 (bench_stage0.engine_config) = 196, rounded up to a multiple of 64
    # (Stage0Config.span_align), + the reserved position = 257 slots
    assert engine == {256}
    assert spans(rows, "graph decode", 2) == engine  # matmul and sdpa rows alike
    assert spans(rows, "graph decode", 1) == engine  # same slot length at every batch
    assert spans(rows, "graph prefill", 1) == engine


def test_slot_len_sets_the_span_of_graph_and_engine_rows(tmp_path: Path) -> None:
    rows = run_bench(tmp_path, "--slot-len", "260", "--decode-attention", "matmul")
    assert spans(rows, "engine step decode", 2) == spans(rows, "graph decode", 2) == {259}


def test_slot_len_too_short_for_the_engine_rows_is_refused() -> None:
    from bench.bench_stage0 import engine_args, engine_config

    args = engine_args(argparse.Namespace(context=64), engine_units=1, slot_len=100)
    with pytest.raises(SystemExit, match="needs 197"):
        engine_config(1, args, torch.device("cpu"))
    args.slot_len = 197
    config, rules = engine_config(1, args, torch.device("cpu"))
    assert config.slot_len(rules) == 197


def test_slots_size_every_rows_cache_as_a_served_engine(tmp_path: Path) -> None:
    """`--slots` gives the engine rows max(slots, batch) sessions, so a served engine's cache (the flex kernels'
    batch) surrounds a row of a few sessions; the graph rows take the same cache; the JSON says which."""
    from bench.bench_stage0 import engine_args, engine_config

    args = engine_args(argparse.Namespace(context=64), engine_units=1, prefill_attention=["flex"], slots=4)
    assert [engine_config(b, args, torch.device("cpu"))[0].max_sessions for b in (1, 2, 8)] == [4, 4, 8]
    args.slots = 0
    assert engine_config(2, args, torch.device("cpu"))[0].max_sessions == 2
    out = tmp_path / "rows.json"
    run_bench(tmp_path, "--slots", "4", "--prefill-attention", "flex", "--decode-attention", "flex")
    doc = json.loads(out.read_text())
    assert doc["slots"] == 4
    assert {r["name"].split(" [")[0] for r in doc["rows"]} >= {"graph decode", "graph prefill 13",
                                                               "engine step decode", "engine step prefill"}


def test_frame_prefill_row_runs_with_flex(tmp_path: Path) -> None:
    """`--frame-prefill` adds a unit with one camera frame (79 positions) to the graph prefill rows, attending with
    flex past the prefill context. (Here the tiny slot already has room; at full size the KV needed the row's
    room added: the H200 run at 025c29c raised a GraphShapeError, 4175 > 4159.)"""
    rows = run_bench(tmp_path, "--frame-prefill", "--engine-batches", "", "--prefill-batches", "",
                     "--prefill-attention", "flex")
    frame = [r for r in rows if r["name"].startswith("graph prefill 79 [flex]")]
    assert len(frame) == 1 and frame[0]["median_ms"] > 0 and frame[0]["span"] >= 64 + 79


def test_decode_profiler_runs_the_served_graph(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/profile_stage0_decode.py on the CPU (tiny model, eager graphs): one row per attention and batch."""
    sys.path.insert(0, str(REPO))
    from bench.profile_stage0_decode import main

    main(["--tiny", "--batches", "1,2", "--context", "64", "--attention", "matmul", "--compile", "", "--iters", "1"])
    table = capsys.readouterr().out.split("attention | batch")[1].strip().splitlines()[1:]
    assert [line.split(" | ")[:2] for line in table] == [["matmul", "1"], ["matmul", "2"]]


def test_engine_args_fill_only_what_is_missing() -> None:
    """The profilers complete their own options with engine_args: an option they parsed stays, one given wins,
    the rest take the defaults (the flex splits: the model's)."""
    from bench.bench_stage0 import ENGINE_DEFAULTS, engine_args
    from engine.model.llm import Qwen3LLM

    args = engine_args(argparse.Namespace(context=64, slots=32, compile="default"), compile=None, engine_units=2)
    assert (args.slots, args.compile, args.engine_units) == (32, None, 2)
    assert args.flex_prefill_keys_per_split == Qwen3LLM.flex_prefill_keys_per_split
    assert all(hasattr(args, name) for name in ENGINE_DEFAULTS)


def test_graph_rows_take_the_profiles_flex_kernel_options() -> None:
    """With --profile the graph rows run the unit kernel the profile serves (its split, warps and stages); without,
    the command's splits and torch's configuration."""
    from bench.bench_stage0 import graph_flex_options

    args = argparse.Namespace(flex_keys_per_split=512, flex_prefill_keys_per_split=512, profile=None)
    assert graph_flex_options(args) == dict(flex_keys_per_split=512, flex_prefill_keys_per_split=512,
                                            flex_prefill_warps=0, flex_prefill_stages=0)
    args.profile = str(Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "h200.yaml")
    assert graph_flex_options(args) == dict(flex_keys_per_split=512, flex_prefill_keys_per_split=2048,
                                            flex_prefill_warps=4, flex_prefill_stages=2)
