"""bench/soak.py's accounting: the slots the gateway reports, the sample row's refusals, the growth and the verdict
(a leak of any kind fails it). The soak itself runs the real stack (bench/RESULTS.md); these are its pure parts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from bench import soak

METRICS = """# HELP duplex_sessions sessions by state
# TYPE duplex_sessions gauge
duplex_sessions{state="active"} 3.0
duplex_sessions{state="disconnected"} 2.0
duplex_sessions_created_total 41.0
"""


def test_slots_in_use_sums_every_state_of_the_gauge_and_nothing_else():
    assert soak.slots_in_use(METRICS) == 5
    assert soak.slots_in_use("duplex_sessions_created_total 41.0\n") == 0


class FakeServer:
    """No processes (their RSS reads 0) and a gateway that answers /metrics and /ready."""

    def pids(self) -> dict[str, list[int]]:
        return {"gateway": [], "tritonserver": [], "stubs": []}

    def http(self, path: str) -> tuple[int, str]:
        return (200, METRICS) if path == "/metrics" else (200, "")


def test_a_sample_counts_the_refusals_at_capacity_apart_from_the_others(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(soak, "shm_regions", set)
    tally = soak.Tally(alive=3)
    tally.refusals.update({"resource_exhausted": 2, "runtime_unavailable": 5, "connect:OSError": 1})
    row = soak.sample(FakeServer(), tally, 0.0, set())
    assert (row["refusals"], row["refused_full"]) == (8, 2)
    assert (row["slots_in_use"], row["sessions_alive"]) == (5, 3)
    assert row["refused_full"] == 2 and "refused_full" in soak.table([row], 1).splitlines()[0]


def samples(key: str, values: list[float], start: int = 0, every: int = 10) -> list[dict[str, Any]]:
    return [{"t_s": start + i * every, "ready": 200, key: v} for i, v in enumerate(values)]


def test_growth_is_the_last_third_minus_the_first_and_needs_three_samples():
    assert soak.growth(samples("m", [1.0, 2.0]), "m") is None
    assert soak.growth(samples("m", [100.0, 110.0, 120.0, 130.0, 140.0, 150.0]), "m") == 40.0
    assert soak.growth(samples("m", [150.0, 100.0, 160.0, 100.0, 150.0, 100.0]), "m") == 0.0


def clean_final() -> dict[str, Any]:
    return {"slots_in_use": 0, "shm_unmapped": 0}


def rows() -> list[dict[str, Any]]:
    out = samples("gateway_rss_mb", [100.0] * 30)
    for s, stub in zip(out, [50.0] * 15 + [80.0] * 15, strict=True):  # the restart at 150 s: new stubs
        s["stubs_rss_mb"] = stub
    return out


def test_the_verdict_is_ok_only_without_any_leak():
    assert soak.verdict(rows(), clean_final(), soak.Tally(), 0, {})["ok"]
    assert not soak.verdict(rows(), {**clean_final(), "slots_in_use": 1}, soak.Tally(), 0, {})["ok"]
    assert not soak.verdict(rows(), {**clean_final(), "shm_unmapped": 2}, soak.Tally(), 0, {})["ok"]
    assert not soak.verdict(rows(), clean_final(), soak.Tally(), 1, {})["ok"]
    assert not soak.verdict(rows(), clean_final(), soak.Tally(untyped=1), 0, {})["ok"]


def test_the_stubs_growth_counts_only_after_the_restarted_stubs_warmed_up():
    kill = {"killed_at_s": 100, "back_after_s": 10}  # warm from 230 s: every stub sample there reads 80
    v = soak.verdict(rows(), clean_final(), soak.Tally(), 0, kill)
    assert v["stubs_rss_growth_mb_after_restart"] == 0.0
    assert soak.verdict(rows(), clean_final(), soak.Tally(), 0, {})["stubs_rss_growth_mb_after_restart"] == 15.0


def test_a_tally_files_each_error_message_with_its_digits_folded():
    tally = soak.Tally()
    tally.error({"code": "runtime_dead", "message": "the server died after 12 s"})
    tally.error({"code": "runtime_dead", "message": "the server died after 7 s"})
    assert tally.errors == Counter(runtime_dead=2)
    assert tally.error_messages["runtime_dead"] == Counter({"the server died after N s": 2})
