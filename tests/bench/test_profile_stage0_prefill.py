"""bench/profile_stage0_prefill.py: a served cache's slots around the profiled rows, and the flex split's partials.

A served stage0's flex prefill attends over every cache slot (max_sessions + 1), whatever the live rows; the
profiler sized the cache by the batch, so a one-row prefill ran on a 2-slot kernel batch instead of 33.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from bench.bench_stage0 import FULL  # noqa: E402
from bench.profile_stage0_prefill import split_partials  # noqa: E402
from engine.model.llm import Qwen3LLM  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "profile_stage0_prefill.py"), "--tiny", "--rows", "2",
                           "--context", "64", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_rows_run_among_the_requested_slots() -> None:
    done = run("--batches", "1,2", "--slots", "4", "--flex", "--keys-per-split", "0,16")
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("default | ")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("0", "1", "4"), ("16", "1", "4"), ("0", "2", "4"), ("16", "2", "4")]


def test_a_cache_smaller_than_the_batch_is_refused() -> None:
    done = run("--batches", "1,8", "--slots", "4")
    assert done.returncode == 2 and "--slots 4 holds no batch of 8" in done.stderr


def test_split_partials_count_every_slot_and_follow_the_prefill_split() -> None:
    """On CUDA the decoding kernel's partials are [slots + 1, splits, heads, positions, head_dim] in fp32, whatever
    rows are live; longer rows (the flex attention kernel) and the CPU have none."""
    model = argparse.Namespace(flex_prefill_keys_per_split=512)
    kv = argparse.Namespace(slots=32, max_len=8256)
    cuda = torch.device("cuda")  # a device object only: nothing is allocated
    per_split = 33 * FULL.num_attention_heads * 13 * FULL.head_dim * 4
    assert split_partials(model, FULL, kv, 13, cuda) == 17 * per_split  # 119.5 MB at the default 512 keys
    model.flex_prefill_keys_per_split = 4096
    assert split_partials(model, FULL, kv, 13, cuda) == 3 * per_split
    assert split_partials(model, FULL, kv, 79, cuda) is None
    assert split_partials(model, FULL, kv, 13, torch.device("cpu")) is None
    assert Qwen3LLM.flex_prefill_keys_per_split == 512  # the class default the served config starts from
