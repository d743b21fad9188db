"""bench/h200/variant_profile.py: an A/B profile differs from its base in the named settings only, loads as `duplex
serve` loads a profile, and a bad setting writes nothing."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict
from pathlib import Path

import pytest

from build.make_model_repository import DeployProfile, ProfileError

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "profiles" / "h200-scripted.yaml"
_spec = importlib.util.spec_from_file_location("variant_profile", REPO / "bench" / "h200" / "variant_profile.py")
variant_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variant_profile)


def test_a_variant_changes_the_named_settings_only(tmp_path: Path) -> None:
    out = tmp_path / "ab-fast.yaml"
    variant_profile.main([str(BASE), str(out), "engine_options.stage0.decode_attention=matmul",
                          "engine_options.stage0.gemm_pad_buckets=false", "engine_options.tts.gemm_tile_rows=null",
                          "mps_thread_percentage={tts: 50}"])
    base, got = asdict(DeployProfile.load(BASE)), asdict(DeployProfile.load(out))
    assert got["engine_options"]["stage0"]["decode_attention"] == "matmul"
    assert got["engine_options"]["stage0"]["gemm_pad_buckets"] is False
    assert "gemm_tile_rows" not in got["engine_options"]["tts"] and "gemm_tile_rows" in base["engine_options"]["tts"]
    assert got["mps_thread_percentage"] == {"tts": 50}
    for opts in (base["engine_options"], got["engine_options"]):
        opts["stage0"].pop("decode_attention"), opts["stage0"].pop("gemm_pad_buckets", None)
        opts["tts"].pop("gemm_tile_rows", None)
    base.pop("mps_thread_percentage"), got.pop("mps_thread_percentage")
    assert got == base
    assert out.read_text().startswith(f"# {BASE} with ")


@pytest.mark.parametrize("setting,message", [
    ("max_sessions=0", "max_sessions"),                                   # the profile's own check
    ("max_sessionz=3", "unknown field 'max_sessionz'"),
    ("engine_options.stage0.gemm_pad_bucket=false", "unknown option"),    # the bridge's option names
    ("engine_options.stage0.compile_mode.x=1", "not a mapping"),
    ("engine_options.tts.no_such_key=null", "nothing to remove"),
    ("decode_attention", "KEY=VALUE"),
])
def test_a_bad_setting_writes_nothing(tmp_path: Path, setting: str, message: str) -> None:
    out = tmp_path / "bad.yaml"
    with pytest.raises(ProfileError, match=message):
        variant_profile.variant(BASE, out, [setting])
    assert not out.exists()


def test_runs_where_an_installed_build_package_shadows_the_repositorys(tmp_path: Path) -> None:
    """The H100 device's venv has pypa's `build` (a regular package), which wins over the repository's `build/` (a
    namespace directory) whatever the path order: the script then loads the profile code by its directory."""
    import os
    import subprocess
    import sys

    shadow = tmp_path / "site" / "build"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")  # like pypa's build: no make_model_repository inside
    out = tmp_path / "ab.yaml"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "h200" / "variant_profile.py"), str(BASE), str(out),
                           "max_sessions=16"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert DeployProfile.load(out).max_sessions == 16


def test_the_device_plans_variants_are_made_and_differ_where_the_plan_says(tmp_path: Path) -> None:
    """bench/h200/make_variants.py: every variant of the latest plan loads as a profile, and the pairs an A/B
    compares differ in the one setting it is about."""
    spec = importlib.util.spec_from_file_location("make_variants", REPO / "bench" / "h200" / "make_variants.py")
    make_variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_variants)
    make_variants.main([str(tmp_path)])
    load = {p.stem: asdict(DeployProfile.load(p)) for p in tmp_path.glob("ab-*.yaml")}
    assert set(load) == {"ab-64s", "ab-64pb", "ab-64pbm", "ab-64pbmh", "ab-64u", "ab-64uh", "ab-u32", "ab-u32h",
                         "ab-u48h", "ab-a48h", "ab-16", "ab-u48hg", "ab-64uhg"}
    for free, held in (("ab-u48h", "ab-u48hg"), ("ab-64uh", "ab-64uhg")):  # the hold's A/B: that setting only
        assert load[held]["engine_options"]["stage0"].pop("prefill_hold_ms") == 40
        assert "prefill_hold_ms" not in load[free]["engine_options"]["stage0"] and load[held] == load[free]
    for whole, heads in (("ab-64u", "ab-64uh"), ("ab-64pbm", "ab-64pbmh"), ("ab-u32", "ab-u32h")):
        a, b = load[whole], load[heads]
        assert not a["engine_options"]["tts"].get("head_every_unit") and b["engine_options"]["tts"]["head_every_unit"]
        a["engine_options"]["tts"].pop("head_every_unit", None), b["engine_options"]["tts"].pop("head_every_unit")
        assert a == b, (whole, heads)
    assert load["ab-64u"]["unit_align_s"] == 0 and load["ab-64pbm"]["unit_align_min_sessions"] == 24
    assert load["ab-u32"]["kv_window"] == 4096 and load["ab-u32"]["max_sessions"] == 32
    u, a = load["ab-u48h"], load["ab-a48h"]  # the 48-slot pair differs in the alignment only
    assert (u["max_sessions"], u["kv_window"], u["unit_align_s"]) == (48, 2048, 0)
    assert a["unit_align_s"] == 1.0 and a["unit_align_min_sessions"] == 24
    assert a["engine_options"]["stage0"].pop("prefill_batch_buckets") == [2, 4, 8, 16, 32, 64]
    assert {**a, "unit_align_s": 0, "unit_align_min_sessions": 0} == u
    shipped = asdict(DeployProfile.load(REPO / "deploy" / "profiles" / "h200-scripted.yaml"))
    assert load["ab-16"]["max_sessions"] == 16 and {**load["ab-16"], "max_sessions": 32} == shipped
