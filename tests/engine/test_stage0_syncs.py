"""A stage0 step waits on the GPU once: at its id read-back (STYLE.md practice 4). Needs CUDA; skipped elsewhere.

PyTorch's sync debug mode reports every call that blocks the host on the device (a blocking copy, `.item()`,
`nonzero`, a stream synchronize); `read_back` waits on an event, which the mode does not count, so any report
is a sync the step should not have. A hidden sync costs more than its own time: the host stops queueing the
step's next kernels until the GPU drains (on the H200 the sampling line that masked ids held a third of the
stage0 thread's samples at 16 sessions, bench/RESULTS.md stop 15).
"""

from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch

from engine.audio import AudioFrontEnd, StreamConfig
from engine.hostio import to_device
from engine.stage0 import DecodeRules, Stage0Config, Stage0Engine
from tests.engine.test_audio_encoder import build, tiny_audio
from tests.engine.test_stage0_engine import run_schedule
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer

CFG = StreamConfig()
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _syncs_while(run) -> list[str]:
    """file:line of each synchronizing call made by `run()` (sync debug mode "warn"): the innermost frame
    outside torch, so a sync inside a torch helper names its caller."""
    sites: set[str] = set()
    running = False  # only what run() does counts (the first switch into the mode may report on its own)

    def note(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - showwarning's
        if running and "synchronizing" in str(message):
            ours = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}torch{os.sep}" not in f.filename
                    and not f.filename.endswith("warnings.py")]
            sites.add(f"{ours[-1].filename}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            running = True
            run()
        finally:
            running = False
            torch.cuda.set_sync_debug_mode(0)
    return sorted(sites)


class DeviceFakeFrontEnd(FakeFrontEnd):
    """The fabricated encoder with its embeddings made on the GPU, as the real front end's are (the host
    fake's would be copied by the engine: a sync the served path does not have)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.frame_proj = self.proj.cuda(), self.frame_proj.cuda()

    def encode_unit(self, state: dict, pcm: torch.Tensor, unit_index: int) -> torch.Tensor:
        return super().encode_unit(state, to_device(pcm, "cuda"), unit_index)

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        return super().encode_reference(to_device(pcm, "cuda"))


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_steps_make_no_hidden_sync(graphs: bool) -> None:
    model = tiny_llm().cuda()
    events: list = []
    engine = Stage0Engine(model, tiny_tokenizer(), DeviceFakeFrontEnd(), events.append,
                          Stage0Config(max_sessions=8, use_cuda_graphs=graphs), DecodeRules(force_listen_count=1))
    run_schedule(engine, {f"s{i}": 2 * i for i in range(4)}, units=2)  # warm: graphs, pinned buffers, caches
    assert events
    n = len(events)
    syncs = _syncs_while(lambda: run_schedule(engine, {f"t{i}": 2 * i for i in range(4)}, units=3))
    assert len(events) > n  # the measured steps ran units
    assert syncs == [], f"host syncs in the stage0 step: {syncs}"


def test_the_batched_audio_front_end_makes_no_hidden_sync() -> None:
    enc, proj = build(1500, seed=3)
    fe = AudioFrontEnd(enc.cuda(), proj.cuda(), tiny_audio(1500), mel_device="cuda")
    states = [fe.new_session() for _ in range(3)]
    g = torch.Generator().manual_seed(0)

    def units(k: int) -> list[torch.Tensor]:
        n = CFG.first_chunk_samples - CFG.prefix_zeros if k == 0 else CFG.chunk_samples
        return [0.1 * torch.randn(n, generator=g) for _ in states]

    fe.encode_units(states, units(0))  # warm
    syncs = _syncs_while(lambda: [fe.encode_units(states, units(k)) for k in range(1, 4)])
    assert syncs == [], f"host syncs in the audio front end: {syncs}"
