"""The deploy profile's `mps_thread_percentage`: validated, rendered into its stage's config only, read back by the
stage's settings and put into the stage process's environment before CUDA starts (no server, no GPU)."""

from __future__ import annotations

import re

import pytest
from make_model_repository import DeployProfile, ProfileError, render_config

from model_repository.common.settings import MPS_THREADS_ENV, ConfigError, StageSettings, cap_mps_threads

PARAM = re.compile(r'key: "([^"]+)" value: \{ string_value: "((?:[^"\\]|\\.)*)" \}')


def _settings(model: str, profile: DeployProfile) -> StageSettings:
    """What the stage reads in `initialize`: the model config's parameters as Triton hands them over."""
    params = {k: {"string_value": v} for k, v in PARAM.findall(render_config(model, profile, "/ckpt"))}
    return StageSettings.from_model_config({"name": model, "parameters": params})


@pytest.mark.parametrize("value", [{"stage0": 0}, {"stage0": 101}, {"vocoder": 50}, {"tts": True}, {"tts": 50.0},
                                   ["stage0"]])
def test_a_bad_share_names_the_field(value: object) -> None:
    with pytest.raises(ProfileError, match="'mps_thread_percentage'"):
        DeployProfile(device="cuda", mps_thread_percentage=value)  # type: ignore[arg-type]


def test_a_cap_needs_a_gpu() -> None:
    with pytest.raises(ProfileError, match="'mps_thread_percentage'"):
        DeployProfile(device="cpu", mps_thread_percentage={"stage0": 70})


def test_the_cap_reaches_its_stage_only_and_its_environment() -> None:
    profile = DeployProfile(device="cuda", mps_thread_percentage={"stage0": 70})
    capped, free = _settings("stage0", profile), _settings("tts", profile)
    assert (capped.mps_thread_percentage, free.mps_thread_percentage) == (70, 0)
    env = {"PATH": "/bin"}
    assert cap_mps_threads(free, env) is None and env == {"PATH": "/bin"}
    assert cap_mps_threads(capped, env) == 70 and env[MPS_THREADS_ENV] == "70"


def test_the_stage_refuses_a_share_out_of_range() -> None:
    params = {k: {"string_value": v} for k, v in PARAM.findall(render_config("tts", DeployProfile(), "/c"))}
    params["mps_thread_percentage"] = {"string_value": "150"}
    with pytest.raises(ConfigError, match="mps_thread_percentage"):
        StageSettings.from_model_config({"name": "tts", "parameters": params})
