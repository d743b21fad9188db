"""GPU placement (issue 15): the profile's `gpus` reach the instance_group, and each instance Triton
starts takes the GPU Triton gives it (`model_instance_device_id`), not `cuda:0`. CPU-only: the
instances are expanded from the generated config the way Triton does (`count` instances on EACH
listed GPU) and `instance_device` is asked which device each would run on.
"""

from __future__ import annotations

import re

import pytest
from make_model_repository import STAGES, DeployProfile, ProfileError, render_config

from model_repository.common.settings import ConfigError, instance_device

SPLIT = DeployProfile(device="cuda", dtype="bfloat16", tts_instances=2,
                      gpus={"stage0": [0], "tts": [1], "token2wav": [1], "duplex": [0]})


def _instances(config: str) -> list[dict[str, str]]:
    """The `initialize` args (kind and device id) of every instance Triton starts for this config."""
    group = re.search(r"instance_group \[ \{ count: (\d+) kind: (KIND_\w+)(?: gpus: \[ ([\d, ]+) \])? \} \]", config)
    assert group is not None, config
    count, kind, gpus = int(group[1]), group[2], group[3]
    if kind == "KIND_CPU":
        return [{"model_instance_kind": "CPU", "model_instance_device_id": "0"}] * count
    ids = [int(g) for g in gpus.split(",")] if gpus else [0]  # no list: every visible GPU (one here)
    return [{"model_instance_kind": "GPU", "model_instance_device_id": str(g)} for g in ids for _ in range(count)]


def test_split_profile_puts_stage0_and_stage1_on_different_gpus() -> None:
    devices = {m: [instance_device(SPLIT.device, a) for a in _instances(render_config(m, SPLIT, "/c"))]
               for m in STAGES}
    assert devices == {"stage0": ["cuda:0"], "tts": ["cuda:1", "cuda:1"], "token2wav": ["cuda:1"]}


def test_instances_spread_over_every_listed_gpu() -> None:
    profile = DeployProfile(device="cuda", stage0_instances=1, gpus={"stage0": [2, 3]})
    config = render_config("stage0", profile, "/c")
    assert "count: 1 kind: KIND_GPU gpus: [ 2, 3 ]" in config
    assert [instance_device("cuda", a) for a in _instances(config)] == ["cuda:2", "cuda:3"]


def test_no_gpu_list_keeps_the_plain_group() -> None:
    config = render_config("tts", DeployProfile(device="cuda"), "/c")
    assert "instance_group [ { count: 1 kind: KIND_GPU } ]" in config


def test_pinned_device_and_cpu_are_kept() -> None:
    gpu1 = {"model_instance_kind": "GPU", "model_instance_device_id": "1"}
    assert instance_device("cuda:3", gpu1) == "cuda:3"  # an explicit cuda:N in the profile wins
    assert instance_device("cpu", {"model_instance_kind": "CPU", "model_instance_device_id": "0"}) == "cpu"
    assert instance_device("cuda", {}) == "cuda"  # no Triton args (an engine built outside Triton)


def test_gpu_instance_without_an_id_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model_instance_device_id"):
        instance_device("cuda", {"model_instance_kind": "GPU", "model_instance_device_id": ""})


@pytest.mark.parametrize("gpus", [{"vocoder": [0]}, {"tts": []}, {"tts": [1, 1]}, {"tts": [-1]}, {"tts": "1"},
                                  {"tts": [True]}])
def test_bad_gpu_lists_name_the_field(gpus: object) -> None:
    with pytest.raises(ProfileError, match="'gpus'"):
        DeployProfile(device="cuda", gpus=gpus)  # type: ignore[arg-type]


def test_gpu_lists_need_device_cuda() -> None:
    with pytest.raises(ProfileError, match="'gpus'"):
        DeployProfile(device="cpu", gpus={"tts": [0]})
