"""The GPU gate (model_repository/common/gpu_gate.py, deploy profile `gpu_gate`): one holder per device, a waiting
higher stage first, no starvation, a dead holder's lock dropped; rendered into each stage's config and taken
around the engine step by the bridge (the served path: tests/bench/test_load_realtime_e2e.py, whose profile gates
every stage). Gates in one process contend like processes: each opens its own file descriptions."""

from __future__ import annotations

import fcntl
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch
from make_model_repository import DeployProfile, ProfileError, render_config

from model_repository.common import gpu_gate
from model_repository.common.bridges import base
from model_repository.common.bridges.base import EngineBridge
from model_repository.common.gpu_gate import GpuGate
from model_repository.common.settings import ConfigError, StageSettings
from tests.triton.test_mps_threads import (  # the config a stage reads, as Triton hands it over
    PARAM,
    _settings,
)


@pytest.fixture
def gate(tmp_path: Path):  # type: ignore[no-untyped-def]
    """gate(device, priority) -> a GpuGate with its files in tmp_path, closed at teardown."""
    made: list[GpuGate] = []

    def make(device: str, priority: int) -> GpuGate:
        made.append(GpuGate(device, priority, tmp_path))
        return made[-1]
    yield make
    for g in made:
        g.close()


HOLD_S = 0.5  # the waiters start 0.1 and 0.2 s into the hold: room for a loaded CI machine


def _enter(gate: GpuGate, entered: threading.Event) -> None:
    """Hold the gate once; join the thread before the gate's files close (a release on a closed file fails)."""
    with gate.hold():
        entered.set()


def _hold_for(gate: GpuGate, seconds: float, log: list[tuple[str, float, float]], name: str) -> None:
    with gate.hold():
        t0 = time.monotonic()
        time.sleep(seconds)
        log.append((name, t0, time.monotonic()))


def test_one_holder_at_a_time(gate) -> None:  # type: ignore[no-untyped-def]
    log: list[tuple[str, float, float]] = []
    gates = [gate("cuda:0", p % 3) for p in range(6)]
    threads = [threading.Thread(target=_hold_for, args=(g, 0.02, log, str(i))) for i, g in enumerate(gates)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted((t0, t1) for _, t0, t1 in log)
    assert len(spans) == 6
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False)), spans


def test_a_waiting_higher_stage_goes_before_a_lower_one_that_waited_longer(gate) -> None:  # type: ignore[no-untyped-def]
    holder, low, high = (gate("cuda:0", p) for p in (2, 2, 0))
    log: list[tuple[str, float, float]] = []
    first = threading.Thread(target=_hold_for, args=(holder, HOLD_S, log, "holder"))
    first.start()
    time.sleep(HOLD_S / 5)
    waiters = [threading.Thread(target=_hold_for, args=(low, 0.01, log, "low"))]
    waiters[0].start()
    time.sleep(HOLD_S / 5)  # the low stage waits first
    waiters.append(threading.Thread(target=_hold_for, args=(high, 0.01, log, "high")))
    waiters[1].start()
    for t in [first, *waiters]:
        t.join()
    assert [name for name, _, _ in log] == ["holder", "high", "low"], log


def test_the_same_device_only(gate) -> None:  # type: ignore[no-untyped-def]
    """Gates of two devices do not wait for each other."""
    a, b = gate("cuda:0", 1), gate("cuda:1", 1)
    with a.hold():
        done = threading.Event()
        thread = threading.Thread(target=_enter, args=(b, done))
        thread.start()
        assert done.wait(2.0)
        thread.join()


def test_a_lower_stage_is_deferred_for_a_while_but_not_starved(gate, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    low = gate("cpu", 2)
    with open(tmp_path / "cpu.intent0", "a+b") as waiting_high:   # a stage0 that waits and never comes
        fcntl.flock(waiting_high, fcntl.LOCK_SH)
        t0 = time.monotonic()
        with low.hold():
            waited = time.monotonic() - t0
    assert low.deferrals > 0
    assert gpu_gate.MAX_DEFER_S <= waited < gpu_gate.MAX_DEFER_S + 1.0
    t0 = time.monotonic()
    with low.hold():  # nobody waits now: at once
        assert time.monotonic() - t0 < gpu_gate.MAX_DEFER_S


def _hold_forever(directory: str, held: multiprocessing.Event) -> None:  # type: ignore[valid-type]
    g = GpuGate("cuda:0", 1, Path(directory))
    with g.hold():
        held.set()  # type: ignore[attr-defined]
        time.sleep(60)


def test_a_dead_holder_leaves_the_gate_open(gate, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    child = ctx.Process(target=_hold_forever, args=(str(tmp_path), held))
    child.start()
    try:
        assert held.wait(30)
        entered = threading.Event()
        thread = threading.Thread(target=_enter, args=(gate("cuda:0", 0), entered), daemon=True)
        thread.start()
        assert not entered.wait(0.3)  # the child holds it
        child.kill()
        assert entered.wait(5.0)
        thread.join(5.0)
    finally:
        child.kill()
        child.join()


def test_the_gate_of_a_cpu_stage_is_keyed_by_its_name() -> None:
    assert base.gate_device("cpu") == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_bare_cuda_and_its_index_share_one_gate() -> None:
    assert base.gate_device("cuda") == base.gate_device(f"cuda:{torch.cuda.current_device()}")
    assert base.gate_device("cuda").startswith(("gpu-", "cuda:"))


# -- profile, config, settings --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [{"stage0": -1}, {"stage0": 8}, {"vocoder": 1}, {"tts": True}, {"tts": 1.0},
                                   ["stage0"]])
def test_a_bad_priority_names_the_field(value: object) -> None:
    with pytest.raises(ProfileError, match="'gpu_gate'"):
        DeployProfile(gpu_gate=value)  # type: ignore[arg-type]


def test_each_stage_reads_its_own_priority() -> None:
    profile = DeployProfile(gpu_gate={"stage0": 0, "token2wav": 2})
    assert [_settings(m, profile).gpu_gate_priority for m in ("stage0", "tts", "token2wav")] == [0, -1, 2]
    params = {k: {"string_value": v} for k, v in PARAM.findall(render_config("tts", profile, "/c"))}
    params["gpu_gate_priority"] = {"string_value": "9"}
    with pytest.raises(ConfigError, match="gpu_gate_priority"):
        StageSettings.from_model_config({"name": "tts", "parameters": params})


# -- the bridge takes it around a step with work ----------------------------------------------------------------

class _Bridge(EngineBridge):
    """A bridge whose step records whether another gate of its device could get in while it ran."""

    def __init__(self, settings: StageSettings, work: int, probe: GpuGate) -> None:
        super().__init__(settings)
        self.work, self.probe, self.steps, self.outsider_got_in = work, probe, 0, []
        self.probes: list[threading.Thread] = []

    def has_work(self) -> bool:
        return self.work > 0

    def step(self) -> bool:
        if self.work <= 0:
            return False
        got = threading.Event()
        self.probes.append(threading.Thread(target=_enter, args=(self.probe, got), daemon=True))
        self.probes[-1].start()
        self.outsider_got_in.append(got.wait(0.05))
        self.work -= 1
        self.steps += 1
        self.step_rows = 1
        return self.work > 0


def test_the_bridge_holds_the_gate_through_each_step_with_work(gate, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    settings = StageSettings(stage="tts", engine_factory="x:y", checkpoint_dir="", device="cpu", dtype="float32",
                             max_sessions=1, kv_window=1, session_idle_ttl_s=1.0, gpu_gate_priority=1)
    monkeypatch.setattr(base, "GpuGate", lambda device, priority: GpuGate(device, priority, tmp_path))
    bridge = _Bridge(settings, work=3, probe=gate("cpu", 0))
    bridge.start()
    try:
        deadline = time.monotonic() + 10
        while bridge.steps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        bridge.stop()
        for probe in bridge.probes:  # each got in once the step let go
            probe.join(5.0)
    assert bridge.steps == 3
    assert bridge.outsider_got_in == [False, False, False]  # the gate was held during every step
    assert bridge.metrics.totals["gate"].count == 3 and bridge.metrics.totals["step"].count == 3
