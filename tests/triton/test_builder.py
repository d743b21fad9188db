"""build/make_model_repository.py: profile validation and the generated config (no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from make_model_repository import (
    DEFAULT_CHECKPOINT,
    MODELS,
    SOURCE,
    DeployProfile,
    ProfileError,
    render_config,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("field,value", [("max_sessions", 0), ("device", "tpu"), ("dtype", "int8"),
                                         ("engine", "magic"), ("kv_window", -5), ("stage0_instances", True),
                                         ("unit_align_s", -0.5), ("unit_align_s", "1s"), ("unit_align_s", True),
                                         ("unit_align_s", float("inf")), ("unit_align_min_sessions", -1),
                                         ("unit_align_min_sessions", 1.5), ("unit_align_min_sessions", True)])
def test_bad_profile_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ProfileError, match=repr(field)):
        DeployProfile(**{field: value})


def test_idle_timeout_must_cover_session_ttl() -> None:
    with pytest.raises(ProfileError, match="sequence_idle_timeout_s"):
        DeployProfile(session_idle_ttl_s=300, sequence_idle_timeout_s=100)


def test_unit_align_s_is_read_and_printed_by_the_check(tmp_path: Path) -> None:
    """The gateway's alignment period (`duplex serve` reads it from `--check --json`): 0 (off) unless set."""
    assert DeployProfile().unit_align_s == 0.0 and DeployProfile(unit_align_s=0).unit_align_s == 0
    profile = tmp_path / "p.yaml"
    profile.write_text("unit_align_s: 1.5\n")
    assert DeployProfile.load(profile).unit_align_s == 1.5
    done = subprocess.run([sys.executable, str(REPO / "build" / "make_model_repository.py"), "--check", "--json",
                           "--profile", str(profile)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["unit_align_s"] == 1.5
    assert json.loads(done.stdout)["unit_align_min_sessions"] == 0  # align whenever unit_align_s > 0
    profile.write_text("unit_align_s: -1\n")
    done = subprocess.run([sys.executable, str(REPO / "build" / "make_model_repository.py"), "--check",
                           "--profile", str(profile)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "'unit_align_s' has a bad value -1 (a number of seconds >= 0; 0: off)" in done.stderr


def test_unknown_profile_field_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("max_sesions: 3\n")
    with pytest.raises(ProfileError, match="max_sesions"):
        DeployProfile.load(bad)


def test_cli_exit_2_with_field_name(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("dtype: int3\n")
    done = subprocess.run([sys.executable, str(REPO / "build" / "make_model_repository.py"), "--check",
                           "--profile", str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "'dtype'" in done.stderr


def test_config_carries_profile_values() -> None:
    profile = DeployProfile(max_sessions=7, kv_window=1234, device="cuda:1", dtype="bfloat16", tts_instances=3,
                            sequence_idle_timeout_s=400)
    text = render_config("tts", profile, "/ckpt")
    assert "max_batch_size: 7" in text
    assert "count: 3 kind: KIND_GPU" in text
    assert 'key: "kv_window" value: { string_value: "1234" }' in text
    assert 'key: "checkpoint_dir" value: { string_value: "/ckpt" }' in text
    assert "max_sequence_idle_microseconds: 400000000" in text
    assert "data_type: TYPE_UINT64" in text and "decoupled: true" in text


@pytest.mark.parametrize("model", MODELS)
def test_checked_in_configs_match_the_builder(model: str) -> None:
    """model_repository/*/config.pbtxt are the builder's output for deploy/profiles/default.yaml."""
    profile = DeployProfile.load(REPO / "deploy" / "profiles" / "default.yaml")
    assert (SOURCE / model / "config.pbtxt").read_text() == render_config(model, profile, DEFAULT_CHECKPOINT)


@pytest.mark.parametrize("name", ["default.yaml", "h200.yaml", "h200-scripted.yaml", "h200-64-scripted.yaml", "h20.yaml",
                                  "h200x2.yaml", "h200x2-scripted.yaml"])
def test_shipped_profiles_are_valid(name: str) -> None:
    DeployProfile.load(REPO / "deploy" / "profiles" / name)


@pytest.mark.parametrize(("two", "one"), [("h200x2.yaml", "h200.yaml"), ("h200x2-scripted.yaml", "h200-scripted.yaml")])
def test_two_gpu_profiles_run_the_one_gpu_profiles_engines(two: str, one: str) -> None:
    """h200x2 places h200's stages on two GPUs: the same engines and options (they had drifted for ten stops), so
    the two placements' figures compare; only the slots and the placement differ."""
    placed, single = (asdict(DeployProfile.load(REPO / "deploy" / "profiles" / n)) for n in (two, one))
    for key in ("max_sessions", "gpus"):
        placed.pop(key), single.pop(key)
    assert placed == single


def test_engine_names_the_factory_module() -> None:
    assert 'string_value: "model_repository.common.bridges:tts"' in render_config("tts", DeployProfile(), "/c")
    double = DeployProfile(engine="tests.triton.loopback")
    assert 'string_value: "tests.triton.loopback:token2wav"' in render_config("token2wav", double, "/c")
    with pytest.raises(ProfileError, match="'engine'"):
        DeployProfile(engine="no_such_package.engines")


def test_engine_options_reach_only_their_stage() -> None:
    profile = DeployProfile(engine_options={"tts": {"compile_step": True}})
    assert 'key: "engine_options" value: { string_value: "{\\"compile_step\\": true}" }' \
        in render_config("tts", profile, "/c")
    assert "engine_options" not in render_config("stage0", profile, "/c")
    with pytest.raises(ProfileError, match="'engine_options'"):
        DeployProfile(engine_options={"vocoder": {}})


def test_the_tts_first_codes_reach_token2wav_as_its_head_codes() -> None:
    """Token2Wav warms up the head and rest call shapes of the TTS's early first codes: one profile value for both."""
    heads = DeployProfile(engine_options={"tts": {"first_codes": 8}, "token2wav": {"flow_dtype": "float16"}})
    assert '{\\"flow_dtype\\": \\"float16\\", \\"head_codes\\": 8}' in render_config("token2wav", heads, "/c")
    assert '{\\"first_codes\\": 8}' in render_config("tts", heads, "/c")
    assert "head_codes" not in render_config("stage0", heads, "/c")
    assert "head_codes" not in render_config("token2wav", DeployProfile(engine_options={"tts": {}}), "/c")
    assert "head_every_unit" not in render_config("token2wav", heads, "/c")
    every = DeployProfile(engine_options={"tts": {"first_codes": 8, "head_every_unit": True}})
    assert '{\\"head_codes\\": 8, \\"head_every_unit\\": true}' in render_config("token2wav", every, "/c")
