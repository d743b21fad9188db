"""GPU placement on real GPUs (issue 15; needs two CUDA devices, skipped elsewhere): a stage instance that
Triton places on GPU 1 loads, warms up and serves there, and allocates nothing on GPU 0.

    python -m pytest tests/triton/test_placement_gpu.py -q      # on a machine with >= 2 GPUs
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from model_repository.common import bridges
from model_repository.common.settings import instance_device
from tests.triton.test_bridges import send, settings

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
GPU1 = {"model_instance_kind": "GPU", "model_instance_device_id": "1"}


@pytest.mark.parametrize("stage", ["stage0", "tts", "token2wav"])
def test_stage_on_gpu_1_leaves_gpu_0_alone(stage: str, tiny_checkpoint: Path) -> None:
    cuda = dataclasses.replace(settings(stage, tiny_checkpoint), device="cuda", dtype="bfloat16")
    placed = dataclasses.replace(cuda, device=instance_device(cuda.device, GPU1))
    assert placed.device == "cuda:1"
    before = torch.cuda.memory_allocated(0)
    bridge = getattr(bridges, stage)(placed)
    bridge.warm_up(lambda line: None)
    engine = bridge.engine
    modules = {"stage0": lambda: [engine.model], "tts": lambda: [engine.model],
               "token2wav": lambda: [engine.models.flow, engine.models.hift]}[stage]()
    devices = {p.device for m in modules for p in m.parameters()}
    assert devices == {torch.device("cuda:1")}
    assert torch.cuda.current_device() == 1
    bridge.start()
    try:
        sink = send(bridge, op="open", corrid=7, fence=(1, 0, 0), config={})
        assert sink.kinds() == ["opened"]
        if stage == "stage0":
            sink = send(bridge, op="append", corrid=7, fence=(1, 0, 1), pcm=np.zeros(16_480, np.float32))
            assert "unit_done" in sink.kinds()
    finally:
        bridge.stop()
    assert torch.cuda.memory_allocated(0) == before  # nothing of the stage on GPU 0
