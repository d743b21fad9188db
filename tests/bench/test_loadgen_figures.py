"""bench/loadgen: the figures of a run from fabricated receipt stamps, the stage-metric and gateway-metric scrapes,
the CLI's failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.loadgen import gateway_load, stages, text_wait
from bench.loadgen.grid import FIRST_UNIT, UNIT
from bench.loadgen.report import commit_latencies, play, run_figures, unit_audio_steps
from bench.loadgen.user import ResponseLog, UserLog, audio_delta_ms
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _response(rid: str, created: float, recv: list[float], dur_ms: float = 1000.0) -> ResponseLog:
    r = ResponseLog(rid, created)
    r.audio_t, r.audio_ms = list(recv), [dur_ms] * len(recv)
    r.unit_audio_t = {i: t for i, t in enumerate(recv)}
    return r


def test_player_counts_underruns_and_the_largest_gap() -> None:
    # 1 s chunks at 0, 1.0, 2.5 (a 500 ms underrun), 3.5: 4 s of audio over 4.5 s on the player
    p = play(_response("r", 0.0, [0.0, 1.0, 2.5, 3.5]))
    assert p.underruns == 1 and p.underrun_ms == pytest.approx(500.0)
    assert p.max_gap_ms == pytest.approx(1500.0) and p.gaps_ms == pytest.approx([1000.0, 1500.0, 1000.0])
    assert p.audio_ms == 4000.0 and p.span_ms == pytest.approx(4500.0)


def test_commit_latency_pairs_each_commit_with_the_next_response() -> None:
    log = UserLog(0, commits=[1.0, 5.0, 9.0])
    log.responses = {"a": _response("a", 1.5, [1.8, 2.8]), "b": _response("b", 9.2, [9.6])}
    # the commit at 5.0 got no response before the next commit: absent, not 0
    assert commit_latencies(log) == pytest.approx([800.0, 600.0])


def test_run_holds_only_when_every_session_keeps_pace() -> None:
    good = UserLog(0, commits=[0.0])
    good.responses = {"a": _response("a", 0.1, [0.2, 1.2, 2.2])}
    good.responses["a"].unit_text_t = {0: 0.25, 1: 1.21}
    good.responses["a"].cancel_t = 1.5  # one more chunk after the cancel, 700 ms later
    late = UserLog(1)
    late.responses = {"b": _response("b", 0.0, [0.1, 1.6])}  # a 1.5 s chunk gap
    run = run_figures(2, [good, late], scripted=True)
    assert not run["held_realtime"] and run["not_held"] == ["chunk gap 1500 ms > 1200 ms"]
    assert run_figures(1, [good], scripted=True)["held_realtime"]
    assert run["commit_to_first_audio_ms"]["p50"] == pytest.approx(200.0)
    assert run["cancel_to_last_audio_ms"]["p50"] == pytest.approx(700.0)
    assert run["transcript_delay_ms"]["count"] == 2 and run["transcript_delay_ms"]["p50"] == pytest.approx(30.0)
    assert run["underruns"] == 1 and run["max_chunk_gap_ms"] == pytest.approx(1500.0)
    # gaps 1000, 1000 (good), 1500 (late): every interval counted, one over the 1.2 s bound
    assert run["chunk_gap_ms"]["count"] == 3 and run["chunk_gap_ms"]["over_bound"] == 1
    assert run["chunk_gap_ms"]["p50"] == pytest.approx(1000.0)


def test_timeline_and_in_phase_count_show_sessions_that_answer_together() -> None:
    """Three sessions: two get their first audio 50 ms apart (each has one other session in phase), the third
    400 ms later (none); the timeline is relative to the first session's open."""
    logs = []
    for i, (opened, first) in enumerate(((10.0, 12.0), (10.2, 12.05), (10.5, 12.45))):
        log = UserLog(i, opened_t=opened, commits=[first - 0.2])
        log.responses = {"r": _response("r", first - 0.1, [first, first + 1.0])}
        logs.append(log)
    run = run_figures(3, logs, scripted=True)
    assert run["first_audio_in_phase"] == pytest.approx(2 / 3, abs=1e-3)
    assert run["per_session"][1]["timeline"] == {"opened_s": 0.2, "commits_s": [1.85], "first_audio_s": [2.05]}
    assert run_figures(1, [UserLog(0)], scripted=False)["first_audio_in_phase"] is None


def test_unit_latency_by_position_in_the_response() -> None:
    """Units sent on the grid (0.2 s appends) whose audio comes 200, 300 and
    450 ms after them: the latency grows along the response, each position its own figure."""
    log = UserLog(0)
    log.chunk_sent = [0.2 * (k + 1) for k in range(60)]  # append k carries input samples 3200k ... 3200k + 3199
    r = ResponseLog("r", 2.0)
    sent = {u: log.chunk_sent[(FIRST_UNIT + u * UNIT - 1) // 3200] for u in (2, 3, 4)}  # its last sample's append
    r.unit_audio_t = {2: sent[2] + 0.2, 3: sent[3] + 0.3, 4: sent[4] + 0.45}
    r.audio_t, r.audio_ms = sorted(r.unit_audio_t.values()), [1000.0] * 3
    log.responses = {"r": r}
    run = run_figures(1, [log], scripted=True)
    by_position = run["unit_to_audio_by_position_ms"]
    assert [by_position[k]["p50"] for k in ("1", "2", "3")] == pytest.approx([200.0, 300.0, 450.0])
    assert by_position["4+"]["count"] == 0
    # from one unit to the next the audio came 100, then 150 ms later: no pair's first audio 1.2 s apart
    steps = run["unit_to_audio_step_ms"]
    assert (steps["count"], steps["over_200"]) == (2, 0)
    assert steps["p50"] == pytest.approx(125.0) and steps["p99"] == pytest.approx(149.5)


def test_unit_audio_steps_pair_only_neighbours_whose_send_is_known() -> None:
    """A step over 200 ms counts as two units' first audio over 1.2 s apart; a unit past the known grid has no
    step, and no step joins two responses."""
    log = UserLog(0)
    log.chunk_sent = [0.2 * (k + 1) for k in range(40)]  # the grid known up to 8 s
    sent = {u: log.chunk_sent[(FIRST_UNIT + u * UNIT - 1) // 3200] for u in (2, 3, 5)}
    a, b = ResponseLog("a", 2.0), ResponseLog("b", 5.0)
    a.unit_audio_t = {2: sent[2] + 0.2, 3: sent[3] + 0.45, 40: 50.0}  # unit 40: past the grid, no send time
    b.unit_audio_t = {5: sent[5] + 0.3}
    log.responses = {"a": a, "b": b}
    assert unit_audio_steps(log) == pytest.approx([250.0])
    run = run_figures(1, [log], scripted=True)
    assert (run["unit_to_audio_step_ms"]["count"], run["unit_to_audio_step_ms"]["over_200"]) == (1, 1)


def test_a_session_without_audio_or_with_a_failure_does_not_hold() -> None:
    failed = UserLog(0, failure="open refused: resource_exhausted")
    failed.errors["resource_exhausted"] += 1
    run = run_figures(1, [failed], scripted=False)
    assert not run["held_realtime"] and run["errors"] == {"resource_exhausted": 1}
    assert not run_figures(1, [UserLog(0)], scripted=False)["held_realtime"]


def test_first_unit_stages_come_from_each_responses_stage_metrics() -> None:
    rs = [_response(f"r{i}", 0.0, [0.5]) for i in range(3)]
    rs[0].stage_metrics = {"0": {"stage": "thinker", "ttft_ms": 40.0},
                           "1": {"stage": "talker", "first_output_ms": 60.0, "from_unit_ms": 200.0},
                           "2": {"stage": "code2wav", "first_output_ms": 90.0, "from_unit_ms": 300.0}}
    rs[1].stage_metrics = {"0": {"stage": "thinker", "ttft_ms": 60.0},
                           "1": {"stage": "talker", "first_output_ms": 80.0, "from_unit_ms": 220.0},
                           "2": {"stage": "code2wav", "first_output_ms": None}}  # cancelled before any audio
    log = UserLog(0, opened_t=0.0)
    log.responses = {r.response_id: r for r in rs}  # rs[2]: no stage_metrics (the client turned them off)
    stages_ms = run_figures(1, [log], scripted=True)["first_unit_stages_ms"]
    assert stages_ms["thinker_ttft"] == {"p50": 50.0, "p99": 59.8, "count": 2}
    assert stages_ms["talker_first_output"]["count"] == 2 and stages_ms["talker_first_output"]["p50"] == 210.0
    assert stages_ms["code2wav_first_output"] == {"p50": 300.0, "p99": 300.0, "count": 1}
    assert stages_ms["talker_own"]["p50"] == 70.0 and stages_ms["code2wav_own"] == {"p50": 90.0, "p99": 90.0, "count": 1}


def test_unit_stages_by_position_come_from_each_owned_units_times() -> None:
    rs = [_response(f"r{i}", 0.0, [0.5]) for i in range(2)]
    rs[0].stage_metrics = {"0": {"stage": "thinker", "from_unit_ms_by_unit": [30.0, 40.0, 50.0, 60.0, 70.0]},
                           "1": {"stage": "talker", "from_unit_ms_by_unit": [100.0, 150.0, None]},
                           "2": {"stage": "code2wav", "from_unit_ms_by_unit": [200.0, 260.0]}}
    rs[1].stage_metrics = {"0": {"stage": "thinker", "from_unit_ms_by_unit": [10.0]},
                           "1": {"stage": "talker"}}  # a gateway without the lists (the one-stream pipeline)
    log = UserLog(0, opened_t=0.0)
    log.responses = {r.response_id: r for r in rs}
    got = run_figures(1, [log], scripted=True)["unit_stages_by_position_ms"]
    assert got["thinker_done"]["1"] == {"p50": 20.0, "p99": 29.8, "count": 2}
    assert got["thinker_done"]["4+"] == {"p50": 65.0, "p99": 69.9, "count": 2}  # positions 4 and 5
    assert got["talker_first"]["2"]["p50"] == 150.0 and got["talker_first"]["3"]["count"] == 0  # None: no time
    assert (got["code2wav_first"]["1"]["p50"], got["code2wav_first"]["2"]["p50"]) == (200.0, 260.0)


def test_unit_step_sources_cut_each_step_by_the_stage_whose_time_grew() -> None:
    log = UserLog(0)
    log.chunk_sent = [0.2 * (k + 1) for k in range(40)]
    sent = {u: log.chunk_sent[(FIRST_UNIT + u * UNIT - 1) // 3200] for u in (2, 3, 4)}
    a = ResponseLog("a", 2.0)
    a.unit_audio_t = {2: sent[2] + 0.30, 3: sent[3] + 0.35, 4: sent[4] + 0.50}  # steps of 50 and 150 ms
    a.stage_metrics = {"0": {"from_unit_ms_by_unit": [100.0, 110.0, 140.0]},
                       "1": {"from_unit_ms_by_unit": [160.0, 170.0, 220.0]},
                       "2": {"from_unit_ms_by_unit": [250.0, 290.0, 380.0]}}
    b = ResponseLog("b", 9.0)  # its lists do not match its audio units: not cut
    b.unit_audio_t = {30: 20.0, 31: 21.5}
    b.stage_metrics = {"0": {"from_unit_ms_by_unit": [1.0]}, "1": {"from_unit_ms_by_unit": [2.0]},
                       "2": {"from_unit_ms_by_unit": [3.0]}}
    log.responses = {"a": a, "b": b}
    got = run_figures(1, [log], scripted=True)["unit_step_sources_ms"]
    # 2 -> 3: stage0 +10, TTS's own part level, Token2Wav's +30, the rest +10; 3 -> 4: +30, +20, +40, +60
    assert got["all"] == pytest.approx({"count": 2, "step": 100.0, "stage0": 20.0, "tts": 10.0, "token2wav": 35.0,
                                        "rest": 35.0})
    assert got["big"] == pytest.approx({"count": 1, "step": 150.0, "stage0": 30.0, "tts": 20.0, "token2wav": 40.0,
                                        "rest": 60.0})
    none = run_figures(1, [UserLog(0)], scripted=True)["unit_step_sources_ms"]
    assert none["all"] == {"count": 0, "step": None, "stage0": None, "tts": None, "token2wav": None, "rest": None}


def test_audio_delta_duration_from_base64_length() -> None:
    import base64

    pcm = bytes(2 * 2401)  # 2401 samples at 24 kHz (odd byte count for base64 padding)
    ev = {"delta": base64.b64encode(pcm).decode(), "sample_rate_hz": 24000}
    assert audio_delta_ms(ev) == pytest.approx(2401 / 24.0)


EXPOSITION = """# TYPE duplex_stage_rows_per_step histogram
duplex_stage_rows_per_step_count{stage="stage0"} 10
duplex_stage_rows_per_step_sum{stage="stage0"} 25
duplex_stage_rows_per_step_bucket{stage="stage0",le="1"} 2
duplex_stage_step_seconds_count{stage="tts"} 4
duplex_stage_step_seconds_sum{stage="tts"} 0.2
nv_inference_count{model="stage0",version="1"} 7
"""


def test_stage_means_are_deltas_over_the_run() -> None:
    before = stages.parse(EXPOSITION)
    after = stages.parse(EXPOSITION.replace("} 10", "} 14").replace("} 25", "} 37").replace("} 4\n", "} 6\n")
                         .replace("} 0.2", "} 0.3"))
    m = stages.means(before, after)
    assert m["rows_per_step"] == {"stage0": 3.0, "tts": None, "token2wav": None}
    assert m["step_ms"]["tts"] == pytest.approx(50.0)
    # 0.1 s more of TTS steps over 2 s: 50 ms of steps per second; no step of the others
    assert stages.busy(before, after, 2.0) == {"stage0": 0.0, "tts": pytest.approx(50.0), "token2wav": 0.0}


KIND_STEPS = """duplex_stage_kind_step_seconds_count{stage="stage0",kind="prefill"} %d
duplex_stage_kind_step_seconds_sum{stage="stage0",kind="prefill"} %s
duplex_stage_kind_step_seconds_bucket{stage="stage0",kind="prefill",le="0.1"} 1
duplex_stage_kind_rows_per_step_count{stage="stage0",kind="prefill"} %d
duplex_stage_kind_rows_per_step_sum{stage="stage0",kind="prefill"} %d
duplex_stage_kind_step_seconds_count{stage="stage0",kind="decode"} %d
duplex_stage_kind_step_seconds_sum{stage="stage0",kind="decode"} %s
duplex_stage_kind_rows_per_step_count{stage="stage0",kind="decode"} %d
duplex_stage_kind_rows_per_step_sum{stage="stage0",kind="decode"} %d
duplex_stage_step_seconds_count{stage="stage0"} 9
"""


def test_stage_steps_by_kind_are_deltas_per_kind() -> None:
    """stage0's prefill and decode steps apart (model_repository/common/metrics.py, `kind`), over the run only;
    a kind with no step in the run is left out."""
    before = stages.parse(KIND_STEPS % (5, "0.1", 5, 6, 7, "0.05", 7, 9))
    after = stages.parse(KIND_STEPS % (9, "0.18", 9, 14, 7, "0.05", 7, 9))
    assert stages.by_kind(before, after) == {"stage0": {"prefill": {"steps": 4, "mean_rows": 2.0, "mean_ms": 20.0}}}
    after = stages.parse(KIND_STEPS % (9, "0.18", 9, 14, 17, "0.13", 17, 39))
    assert stages.by_kind(before, after)["stage0"]["decode"] == {"steps": 10, "mean_rows": 3.0, "mean_ms": 8.0}
    assert stages.by_kind(before, before) == {}


def test_p12_sets_the_token_rows_per_step_against_the_sessions_speaking() -> None:
    """`token` steps' rows (model_repository/common/metrics.py) over the mean sessions speaking (audio seconds over
    the level's seconds)."""
    by_kind = {"stage0": {"decode": {"steps": 10, "mean_rows": 3.0, "mean_ms": 8.0},
                          "token": {"steps": 12, "mean_rows": 6.5, "mean_ms": 9.0}}}
    p = stages.occupancy(by_kind, audio_s=400.0, seconds=50.0)  # 8 sessions' voices at once, on average
    assert p == {"token_rows_per_step": 6.5, "speaking_sessions": 8.0, "share": 0.812, "met": True}
    assert stages.occupancy(by_kind, audio_s=500.0, seconds=50.0)["met"] is False  # 6.5 < 0.8 x 10
    assert stages.occupancy({"stage0": {"decode": by_kind["stage0"]["decode"]}}, 400.0, 50.0)["share"] is None
    assert stages.occupancy(by_kind, audio_s=0.0, seconds=50.0)["met"] is None  # nobody spoke: no figure


STEP_BUCKETS = """duplex_stage_step_seconds_bucket{stage="stage0",le="0.1"} %d
duplex_stage_step_seconds_bucket{stage="stage0",le="0.25"} %d
duplex_stage_step_seconds_bucket{stage="stage0",le="1"} %d
duplex_stage_step_seconds_bucket{stage="stage0",le="+Inf"} %d
duplex_stage_graph_misses_total{stage="stage0",kind="decode"} %d
duplex_stage_graph_misses_total{stage="stage0",kind="prefill"} %d
"""


def test_stage_tails_find_the_slow_steps_a_mean_hides() -> None:
    before = stages.parse(STEP_BUCKETS % (50, 50, 50, 50, 1, 0))
    # 200 more steps: 195 under 100 ms, 2 under 250 ms, 3 under 1 s; 3 more misses over two kinds
    after = stages.parse(STEP_BUCKETS % (245, 247, 250, 250, 2, 2))
    t = stages.tails(before, after)
    assert t["slow_steps"]["stage0"] == 3
    assert t["step_p99_ms"]["stage0"] == pytest.approx(1000.0)  # the 198th of 200 steps lies in (0.25, 1]
    assert t["graph_misses"]["stage0"] == 3
    assert t["step_p99_ms"]["tts"] is None and t["slow_steps"]["tts"] is None


def test_text_wait_quantiles_come_from_the_gateway_histogram_over_the_step() -> None:
    from gateway.observability import GatewayMetrics

    m = GatewayMetrics(4, process_defaults=False)
    m.transcript_delayed(5.0, True, True)  # before the step: must not count
    before = text_wait.parse(m.render()[0].decode())
    for s in (0.31, 0.32, 0.33, 0.34, 0.45):  # audio pairs: each waited for its unit's speech
        m.transcript_delayed(s, True, True)
    m.transcript_delayed(0.025, False, False)  # a text-only delta, timed from the gateway's receipt
    f = text_wait.figures(before, text_wait.parse(m.render()[0].decode()))
    assert f["count"] == 6 and f["start"] == {"sampled": 5, "received": 1}
    # rank 3 of 6 lies in (0.2, 0.35], which holds 4 of them after the 1 below 0.03: 200 + 150 * 2/4 ms
    assert f["p50"] == pytest.approx(275.0)
    assert f["p99"] == pytest.approx(350.0 + 150.0 * (5.94 - 5) / 1)  # inside (0.35, 0.5]
    assert f["within_30ms"] == pytest.approx(1 / 6, abs=1e-3)
    assert f["mean"] == pytest.approx((0.31 + 0.32 + 0.33 + 0.34 + 0.45 + 0.025) / 6 * 1000, abs=0.1)  # exact
    assert f["by_response"]["audio"]["count"] == 5 and f["by_response"]["text"]["p50"] == pytest.approx(25.0)
    assert "sampled" in f["measures"]
    empty = text_wait.figures(None, None)
    assert empty["p50"] is None and empty["mean"] is None and empty["count"] == 0


def test_gateway_load_reads_the_gateways_cpu_and_loop_lag_over_the_step() -> None:
    from gateway.observability import GatewayMetrics

    m = GatewayMetrics(4)  # with the process collector: process_cpu_seconds_total
    m.loop_lag.observe(0.9)  # before the step: must not count
    before_text = m.render()[0].decode()
    for s in [0.0005] * 90 + [0.004] * 8 + [0.06, 0.3]:  # 100 probes: 2 waited more than 50 ms
        m.loop_lag.observe(s)
    sum(i * i for i in range(300_000))  # some CPU time for the process counter
    after_text = m.render()[0].decode()
    before, after = gateway_load.parse(before_text), gateway_load.parse(after_text)
    assert after["cpu"] >= before["cpu"] > 0
    f = gateway_load.figures(before, after, seconds=2.0)
    lag = f["loop_lag_ms"]
    assert lag["count"] == 100 and lag["over_50ms"] == pytest.approx(0.02)
    assert lag["p50"] == pytest.approx(1000 * 0.001 * 50 / 90, abs=0.05)  # rank 50 of the 90 in (0, 1 ms]
    assert lag["p99"] == pytest.approx(100.0)  # rank 99 is the 60 ms probe, at the top of (50, 100 ms]
    assert lag["mean"] == pytest.approx(1000 * (90 * 0.0005 + 8 * 0.004 + 0.36) / 100, abs=0.1)
    assert f["cpu_share"] == pytest.approx((after["cpu"] - before["cpu"]) / 2.0, abs=1e-3)
    empty = gateway_load.figures(None, after, seconds=2.0)
    assert empty["cpu_share"] is None and empty["loop_lag_ms"]["count"] == 0


def test_unreachable_gateway_fails_loudly(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "load_realtime.py"), "--url", f"ws://127.0.0.1:{port}",
                           "--sessions", "2", "--duration", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert f"cannot reach the gateway at ws://127.0.0.1:{port}" in proc.stderr
    assert not out.exists()


def test_sweep_runs_n_in_order_and_stops_at_the_first_n_not_held(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import load_realtime

    async def fake_run_step(n: int, args: object, speech: object, plan: object = None) -> list[UserLog]:
        logs = [UserLog(i, opened_t=0.0) for i in range(n)]
        for log in logs:  # 1 s chunks every second up to N=8, every 1.5 s beyond: not real time
            period = 1.0 if n <= 8 else 1.5
            log.responses = {"r": _response("r", 0.0, [k * period for k in range(4)])}
        return logs

    monkeypatch.setattr(load_realtime, "check_ready", lambda url: None)
    monkeypatch.setattr(load_realtime, "speech_fixtures", lambda: [])
    monkeypatch.setattr(load_realtime, "run_step", fake_run_step)
    monkeypatch.setattr(load_realtime, "scrape_gateway", lambda url: "")
    out = tmp_path / "r.json"
    assert load_realtime.main(["--url", "ws://x:1", "--sessions", "1,8,16,32", "--duration", "5",
                               "--profile", str(REPO / "deploy/profiles/h200-scripted.yaml"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["sessions"] for r in doc["runs"]] == [1, 8, 16]  # 16 did not hold: 32 never ran
    assert [r["held_realtime"] for r in doc["runs"]] == [True, True, False]
    assert doc["scripted"] is True and all(r["scripted"] for r in doc["runs"])
    assert doc["scripted_plan"] == {"listen_units": 3, "speak_units": 3, "text_ids_per_unit": 4, "tail_listen_units": 0}
    assert doc["runs"][0]["stage_rows_per_step"] == {"stage0": None, "tts": None, "token2wav": None}
    assert doc["runs"][0]["transcript_behind_generation_ms"]["count"] == 0


def test_a_server_that_opens_no_session_fails_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import load_realtime

    async def refused(n: int, args: object, speech: object, plan: object = None) -> list[UserLog]:
        return [UserLog(i, failure="open refused: runtime_unavailable") for i in range(n)]

    monkeypatch.setattr(load_realtime, "check_ready", lambda url: None)
    monkeypatch.setattr(load_realtime, "speech_fixtures", lambda: [])
    monkeypatch.setattr(load_realtime, "run_step", refused)
    monkeypatch.setattr(load_realtime, "scrape_gateway", lambda url: "")
    assert load_realtime.main(["--url", "ws://x:1", "--sessions", "2", "--duration", "5",
                               "--out", str(tmp_path / "r.json")]) == 2
    assert "no session of 2 could open at ws://x:1: open refused: runtime_unavailable" in capsys.readouterr().err
