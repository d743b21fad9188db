"""bench/bench_load.py: the tiny CPU smoke run, its full-size config, and the loader records it reads."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import load_checkpoint
from tests.engine.test_tiny_checkpoint import _real_config

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_load.py"
FORWARDS = {"llm_prefill", "audio_unit", "vision_frame", "tts_condition_step", "flow_chunk", "hift_chunk"}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_load", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_full_size_config_is_the_spec_config(bench: ModuleType, tmp_path: Path) -> None:
    """The bench's §8.2 config and the test suite's independent restatement parse to the same config."""
    path = bench.write_full_size_config(tmp_path / "full")
    assert ModelConfig.from_file(path / "config.json") == _real_config()


def test_tiny_smoke_run(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    res = bench.main(["--tiny", "--dtype", "fp32", "--llm-positions", "20", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert {f["forward"] for f in res["forwards"]} == FORWARDS
    assert all(f["finite"] for f in res["forwards"])
    by_name = {f["forward"]: f for f in res["forwards"]}
    assert by_name["llm_prefill"]["shapes"][0][1] == 20
    names = [r["component"] for r in res["components"]]
    assert names == ["llm", "apm", "audio_projection_layer", "vpm", "resampler", "tts", "token2wav.flow",
                     "token2wav.hift"]
    assert all(r["param_bytes"] > 0 for r in res["components"])
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("hift_chunk")  # the table is last


def test_loader_logs_bytes_per_component(tiny_ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.loader.checkpoint"):
        ck = load_checkpoint(tiny_ckpt, dtype=torch.float32, dummy=True, seed=1)
    logged = {r.component: r for r in caplog.records if hasattr(r, "component")}
    for name, module in ck.model.components().items():
        assert logged[name].bytes == sum(p.numel() * p.element_size() for p in module.parameters())
        assert logged[name].device_bytes is None  # CPU: no allocator to read
    assert "token2wav" in logged  # the tiny checkpoint ships Token2Wav assets
