"""Each bridge's `step_rows` equals the rows its engine step really ran (the batch occupancy the stage metrics
report), and the engine loop records steps and queue waits. Real bridges on the tiny checkpoint, no server."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_repository.common import bridges
from model_repository.common.codec import StageOutput, StageRequest
from model_repository.common.settings import StageSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))
from make_tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

FIRST = 16_480
MAX_STEPS = 500


class Sink:
    def __init__(self) -> None:
        self.outs: list[StageOutput] = []
        self.done = threading.Event()

    def emit(self, out: StageOutput) -> None:
        self.outs.append(out)

    def close(self) -> None:
        self.done.set()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), 0, vision=False)


def make(stage: str, ckpt: Path) -> Any:
    return getattr(bridges, stage)(StageSettings(
        stage=stage, engine_factory=f"model_repository.common.bridges:{stage}", checkpoint_dir=str(ckpt),
        device="cpu", dtype="float32", max_sessions=4, kv_window=4096, session_idle_ttl_s=60))


def counting(obj: Any, name: str, size: Callable[[Any], int], seen: list[int]) -> None:
    """Wrap `obj.name(work, ...)` to record how many rows each engine call really ran."""
    inner = getattr(obj, name)

    def wrapped(*args: Any, **kw: Any) -> Any:
        out = inner(*args, **kw)
        seen.append(size(out if name == "_collect" else args[0]))
        return out

    setattr(obj, name, wrapped)


def drive(bridge: Any, seen: list[int], feed: dict[int, Callable[[], None]]) -> list[tuple[int, int]]:
    """Step the bridge on this thread (as its engine thread would); `feed[k]` runs before step k.
    Returns (step_rows, rows the engine ran) per step that had work."""
    pairs, k = [], 0
    while k < MAX_STEPS:
        if k in feed:
            feed[k]()
        seen.clear()
        busy = bridge.step()
        if seen:
            pairs.append((bridge.step_rows, seen[0]))
        k += 1
        if not busy and k > max(feed, default=0):
            return pairs
    raise AssertionError("the engine did not go idle")


def req(bridge: Any, **kw: Any) -> Sink:
    sink = Sink()
    bridge.handle(StageRequest(**kw), sink)
    return sink


def pcm(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(FIRST) * 0.1).astype(np.float32)


def test_stage0_rows_are_the_sessions_in_the_forward(ckpt: Path) -> None:
    s0, seen = make("stage0", ckpt), []
    counting(s0.engine.runner, "forward", len, seen)
    feed = {0: lambda: [req(s0, corrid=c, op="open", fence=(1, 0, 0)) for c in (1, 2, 3)],
            2: lambda: req(s0, corrid=1, op="append", fence=(1, 0, 1), pcm=pcm(1)),
            3: lambda: [req(s0, corrid=c, op="append", fence=(1, 0, 1), pcm=pcm(c)) for c in (2, 3)]}
    pairs = drive(s0, seen, feed)
    assert all(rows == ran for rows, ran in pairs), pairs
    assert {ran for _, ran in pairs} >= {1, 3}  # alone, and all three together


def test_tts_and_token2wav_rows_are_the_units_in_the_batch(ckpt: Path) -> None:
    tts, t2w = make("tts", ckpt), make("token2wav", ckpt)
    tts_seen: list[int] = []
    t2w_seen: list[int] = []
    counting(tts.engine, "_collect", len, tts_seen)
    counting(t2w.engine, "_run_flow", len, t2w_seen)
    rng = np.random.default_rng(0)
    codes: dict[int, Sink] = {}

    def tts_units() -> None:
        for c in (1, 2):
            req(tts, corrid=c, op="open", fence=(1, 0, 0), config={"seed": c})
            codes[c] = req(tts, corrid=c, op="append", fence=(1, 0, 1), tokens=np.arange(4),
                           hidden=rng.standard_normal(4 * tts.llm_dim).astype(np.float32),
                           config={"unit": 0, "is_turn_eos": [False] * 4, "turn_start": True})

    tts_pairs = drive(tts, tts_seen, {0: tts_units})
    assert tts_pairs and all(rows == ran for rows, ran in tts_pairs) and tts_pairs[0][1] == 2, tts_pairs

    def t2w_units() -> None:
        for c in (1, 2):
            req(t2w, corrid=c, op="open", fence=(1, 0, 0), config={"seed": c})
            req(t2w, corrid=c, op="append", fence=(1, 0, 1), tokens=codes[c].outs[0].tokens,
                config={"unit": 0, "end_of_turn": True})

    t2w_pairs = drive(t2w, t2w_seen, {0: t2w_units})
    assert t2w_pairs and all(rows == ran for rows, ran in t2w_pairs) and t2w_pairs[0][1] == 2, t2w_pairs


def test_the_engine_loop_records_steps_and_queue_waits(ckpt: Path) -> None:
    s0 = make("stage0", ckpt)
    s0.start()
    try:
        sinks = [Sink(), Sink()]
        s0.submit(StageRequest(corrid=9, op="open", fence=(1, 0, 0)), sinks[0])
        s0.submit(StageRequest(corrid=9, op="append", fence=(1, 0, 1), pcm=pcm(9)), sinks[1])
        assert all(s.done.wait(60) for s in sinks)
    finally:
        s0.stop()
    totals = s0.metrics.totals
    assert totals["wait"].count == 2 and totals["rows"].count == totals["step"].count > 0
    assert totals["rows"].total == totals["rows"].count  # one session: one row per step
