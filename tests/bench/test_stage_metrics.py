"""model_repository/common/metrics.py: the engine thread only buffers; the flusher hands values to Triton."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from model_repository.common.metrics import FAMILIES, StageMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))
from make_model_repository import DeployProfile, ProfileError  # noqa: E402


class _Histogram:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def test_observations_reach_triton_only_at_flush() -> None:
    sink = {key: _Histogram() for key in FAMILIES}
    m = StageMetrics("tts", histograms=lambda stage: sink)
    m.step(rows=3, seconds=0.02)
    m.step(rows=5, seconds=0.04)
    m.queue_wait(0.001)
    assert sink["rows"].values == []  # nothing crossed to Triton from the engine thread
    m.flush()
    assert sink["rows"].values == [3.0, 5.0] and sink["step"].values == [0.02, 0.04]
    assert sink["wait"].values == [0.001]
    assert m.totals["rows"].mean == 4.0
    m.flush()
    assert sink["rows"].values == [3.0, 5.0]  # each value once


class _KindSink(dict):
    """The families by key, and the by-kind histograms as `_TritonHistograms.by_kind` makes them."""

    def __init__(self) -> None:
        super().__init__({key: _Histogram() for key in FAMILIES})
        self.kinds: dict[tuple[str, str], _Histogram] = {}

    def by_kind(self, key: str, kind: str) -> _Histogram:
        return self.kinds.setdefault((key, kind), _Histogram())


def test_a_step_with_a_kind_is_also_observed_under_it() -> None:
    sink = _KindSink()
    m = StageMetrics("stage0", histograms=lambda stage: sink)
    m.step(rows=2, seconds=0.03, kind="prefill")
    m.step(rows=5, seconds=0.01, kind="decode")
    m.step(rows=1, seconds=0.02)  # a bridge that does not tell
    m.flush()
    assert sink["step"].values == [0.03, 0.01, 0.02]  # every step in the stage's own histograms
    assert sink["rows"].values == [2.0, 5.0, 1.0]
    assert {k: h.values for k, h in sink.kinds.items()} == {
        ("rows", "prefill"): [2.0], ("step", "prefill"): [0.03], ("rows", "decode"): [5.0], ("step", "decode"): [0.01]}
    assert m.kind_totals["step", "prefill"].mean == 0.03 and m.kind_totals["rows", "decode"].mean == 5.0


def test_a_step_that_decoded_tokens_is_also_observed_as_token_with_its_token_rows_only() -> None:
    """P12 counts decoded tokens wherever they ran: a decode step's rows, and a prefill step's token rows beside its
    prefill rows (the shared pass); a step without tokens adds nothing under `token`."""
    sink = _KindSink()
    m = StageMetrics("stage0", histograms=lambda stage: sink)
    m.step(rows=5, seconds=0.01, kind="decode", token_rows=5)
    m.step(rows=6, seconds=0.04, kind="prefill", token_rows=2)
    m.step(rows=3, seconds=0.03, kind="prefill")
    m.flush()
    assert sink.kinds["rows", "token"].values == [5.0, 2.0]
    assert sink.kinds["step", "token"].values == [0.01, 0.04]
    assert sink.kinds["rows", "prefill"].values == [6.0, 3.0]  # the kinds themselves as before
    assert m.kind_totals["rows", "token"].mean == 3.5


def test_outside_triton_only_totals_are_kept() -> None:
    m = StageMetrics("stage0")  # no triton_python_backend_utils in this process
    m.start()
    m.step(rows=2, seconds=0.01)
    m.stop()
    assert m.totals["rows"].count == 1 and m.totals["step"].total == pytest.approx(0.01)


def test_a_slow_step_is_logged_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    m = StageMetrics("stage0")
    with caplog.at_level("WARNING", logger="model_repository.common.metrics"):
        m.step(rows=4, seconds=0.01)
        m.step(rows=7, seconds=0.9)
        m.step(rows=9, seconds=0.6)  # within the interval: counted, not logged
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["stage0: a step took 900 ms for 7 rows (1 steps over 250 ms since the last such line)"]
    assert m.slow_steps == 2


PLAN = {"listen_units": 3, "speak_units": 3, "text_ids_per_unit": 4, "tail_listen_units": 0}


def test_scripted_profiles_are_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    for path in (root / "deploy/profiles/h200-scripted.yaml", root / "tests/e2e/profiles/scripted.yaml",
                 root / "tests/e2e/profiles/scripted-load.yaml"):
        plan = DeployProfile.load(path).engine_options["stage0"]["scripted_decisions"]
        assert set(plan) == set(PLAN)


@pytest.mark.parametrize("plan", [{**PLAN, "speak_units": 0}, {**PLAN, "listen": 2}, {**PLAN, "listen_units": -1},
                                  {**PLAN, "text_ids_per_unit": True}, [3, 3]])
def test_bad_scripted_plan_is_a_profile_error(plan: Any) -> None:
    with pytest.raises(ProfileError, match="engine_options"):
        DeployProfile(engine_options={"stage0": {"scripted_decisions": plan}})


def test_bridge_turns_the_plan_into_a_benchmark_config() -> None:
    from engine.stage0 import Stage0Config
    from engine.stage0.script import ScriptPlan
    from model_repository.common.bridges.stage0_bridge import scripted_decisions
    from model_repository.common.settings import ConfigError

    args = scripted_decisions(PLAN)
    cfg = Stage0Config(**args)
    assert cfg.scripted_decisions and cfg.script_plan == ScriptPlan(3, 3, 4, 0)
    assert scripted_decisions(None) == {}
    with pytest.raises(ConfigError, match="speak_units"):
        scripted_decisions({**PLAN, "speak_units": 0})
