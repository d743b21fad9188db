"""bench/memory_table.py --measured: sessions per GPU from measured per-process figures (issue 15)."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

import pytest
import yaml

from tests.deploy.compose import REPO

GiB = 1024**3


@pytest.fixture(scope="module")
def mt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("memory_table", REPO / "bench" / "memory_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_table"] = module
    spec.loader.exec_module(module)
    return module


def _stage(name: str, used_gib: float, prealloc_gib: float) -> dict:
    used, prealloc = int(used_gib * GiB), int(prealloc_gib * GiB)
    mem = {"device_used": used, "allocated": used, "reserved": used, "peak_allocated": used}
    return {"stage": name, "settings": {"max_sessions": 32}, "after_load": mem, "after_warm_up": mem,
            "preallocated": prealloc, "fixed": used - prealloc}


def test_sessions_follow_from_the_measured_fixed_part(mt: ModuleType) -> None:
    measured = {"device": "NVIDIA H200", "profile": "h200.yaml",
                "stages": [_stage("stage0", 60.0, 36.0), _stage("tts", 16.0, 15.0), _stage("token2wav", 10.0, 7.0)]}
    text = mt.render_measured(mt.default_sizing(), measured)
    fixed = (60 - 36 + 16 - 15 + 10 - 7) * GiB  # 28 GiB
    per_session = (36 + 15 + 7) * GiB / 32 + mt.default_sizing().per_session()["audio KV"]
    want = {g.name: int((g.total_mib * 1024**2 - fixed) // per_session) for g in mt.GPUS}
    assert "| **sum** | | | | **28.00** |" in text
    for name, n in want.items():
        assert f"| {name} | " in text and text.split(f"| {name} | ")[1].split("\n")[0].endswith(f"| {n} |")
    assert want["H200"] > want["H20"] > 0


def test_a_pooled_audio_kv_is_counted_once(mt: ModuleType) -> None:
    """Since stage0 pools the sessions' audio KV (issue 15) it is in stage0's preallocated state: not added again."""
    stage0 = _stage("stage0", 64.0, 40.0) | {"audio_kv_pooled": True}
    measured = {"device": "NVIDIA H200", "profile": "h200.yaml",
                "stages": [stage0, _stage("tts", 16.0, 15.0), _stage("token2wav", 10.0, 7.0)]}
    text = mt.render_measured(mt.default_sizing(), measured)
    fixed, per_session = 28 * GiB, (40 + 15 + 7) * GiB / 32
    h200 = next(g for g in mt.GPUS if g.name == "H200")
    n = int((h200.total_mib * 1024**2 - fixed) // per_session)
    assert text.split("| H200 | ")[1].split("\n")[0].endswith(f"| {n} |")
    assert "the pooled audio KV among it" in text


def test_doc_h20_projection_is_the_script_output() -> None:
    spec = importlib.util.spec_from_file_location("project_h20", REPO / "bench" / "project_h20.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["project_h20"] = module
    spec.loader.exec_module(module)
    block = re.search(r"<!-- project_h20:begin[^>]*-->\n(?P<body>.*?)<!-- project_h20:end -->",
                      (REPO / "docs" / "deploy.md").read_text(), re.S)
    assert block, "docs/deploy.md lost its project_h20 markers"
    assert block["body"] == module.render(), "regenerate: python bench/project_h20.py"
    profile = yaml.safe_load((REPO / "deploy" / "profiles" / "h20.yaml").read_text())
    assert profile["max_sessions"] == module.max_sessions(module.H20, profile["kv_window"])
