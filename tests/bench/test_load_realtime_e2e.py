"""bench/load_realtime.py against the real stack: tritonserver + gateway (tiny checkpoint, CPU) with stage0 on the
scripted plan of tests/e2e/profiles/scripted-load.yaml, two sessions for a few seconds, real WebSockets."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.loadgen import stages
from tests.e2e.stack import Stack, session_cache, wait_stopped

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "tests" / "e2e" / "profiles" / "scripted-load.yaml"
# 3 forced listen units, then the plan speaks units 4-5, 7-8, 10-11: a 12 s run sees two turns per session
DURATION_S = 12
CANCEL_EVERY_S = 4
# errors that would mean the load generator speaks the protocol wrongly
CLIENT_FAULTS = {"bad_event", "unknown_event", "invalid_json", "bad_audio", "unsupported_audio_format",
                 "input_audio_buffer_empty", "response_not_active"}

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def stops_joined() -> Iterator[None]:
    """The session ends after the stack's background stop did."""
    yield
    wait_stopped()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stops_joined: None) -> Iterator[Stack]:
    # the e2e suite's cache: the tiny checkpoint generated once per session
    s = Stack(session_cache(tmp_path_factory), profile=PROFILE, max_sessions=2)
    s.start()
    try:
        yield s
    finally:
        s.stop_soon()


def test_two_sessions_fill_every_field_and_the_stage_metrics(stack: Stack, tmp_path: Path) -> None:
    metrics_url = f"http://127.0.0.1:{stack.triton_ports[2]}/metrics"
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "load_realtime.py"), "--url", f"ws://{stack.addr}",
                           "--sessions", "2", "--duration", str(DURATION_S), "--cancel-every", str(CANCEL_EVERY_S),
                           "--profile", str(PROFILE), "--triton-metrics", metrics_url, "--out", str(out)],
                          capture_output=True, text=True, timeout=200, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[N=2]" in proc.stderr  # progress lines
    assert proc.stdout.splitlines()[-2].startswith("N | held")  # the table comes last

    doc = json.loads(out.read_text())
    assert doc["commit"] != "unknown" and doc["device"] == "cpu" and doc["profile"] == str(PROFILE)
    (run,) = doc["runs"]
    assert run["sessions"] == 2 and run["scripted"] is True and isinstance(run["held_realtime"], bool)
    for key in ("commit_to_first_audio_ms", "cancel_to_last_audio_ms"):
        assert run[key]["p50"] is not None and run[key]["p99"] is not None, (key, run)
    assert run["transcript_delay_ms"]["p50"] is not None
    # where commit -> first audio went: every response's stage_metrics on response.done, stage by stage
    firsts = run["first_unit_stages_ms"]
    assert all(firsts[k]["count"] >= 1 for k in ("thinker_ttft", "talker_first_output", "code2wav_first_output",
                                                 "talker_own", "code2wav_own")), firsts
    assert firsts["talker_first_output"]["p50"] <= firsts["code2wav_first_output"]["p50"], firsts
    assert firsts["talker_own"]["p50"] <= firsts["talker_first_output"]["p50"], firsts   # own input comes later
    # and each owned unit's, by its position in the response: stage0 ends the unit before its TTS codes come
    by_pos = run["unit_stages_by_position_ms"]
    assert all(by_pos[k]["1"]["count"] >= 1 for k in ("thinker_done", "talker_first", "code2wav_first")), by_pos
    assert by_pos["thinker_done"]["1"]["p50"] <= by_pos["talker_first"]["1"]["p50"], by_pos
    # and the steps from one unit to the next cut by stage (2-unit turns; a cancel may leave none timed)
    # only pairs the client timed too: the cut steps are a subset of unit_to_audio_step_ms's
    sources = run["unit_step_sources_ms"]
    assert sources["big"]["count"] <= sources["all"]["count"] <= run["unit_to_audio_step_ms"]["count"], sources
    assert sources["all"]["count"] == 0 or None not in sources["all"].values(), sources
    # P13 from the gateway's /metrics: every delta timed from stage0's sampling stamp (one host, one clock)
    behind = run["transcript_behind_generation_ms"]
    assert behind["p50"] is not None and behind["p99"] is not None and behind["count"] >= 1, behind
    assert behind["start"] == {"sampled": behind["count"], "received": 0}, behind
    assert behind["by_response"]["audio"]["count"] == behind["count"] and "sampled" in behind["measures"]
    assert "text behind gen p50/p99" in proc.stdout
    gw = run["gateway"]  # the real gateway's process CPU and event-loop probes over the level
    assert 0 < gw["cpu_share"] < 2.0 and gw["loop_lag_ms"]["count"] >= 10, gw
    assert gw["loop_lag_ms"]["p50"] is not None and gw["loop_lag_ms"]["p50"] <= gw["loop_lag_ms"]["p99"], gw
    # a cancelled turn may have sent a single chunk: a gap of 0 is a value, not a missing one
    assert isinstance(run["max_chunk_gap_ms"], float) and isinstance(run["underruns"], int)
    assert run["cancels_sent"] >= 1 and run["responses"] >= 2
    assert not set(run["errors"]) & CLIENT_FAULTS, run["errors"]
    assert all(p["audio_s"] > 0 for p in run["per_session"]), run["per_session"]
    # every stage batched rows during the run, and says so on Triton's endpoint
    assert all(run["stage_rows_per_step"][s] >= 1 for s in stages.STAGES), run["stage_rows_per_step"]
    # every stage was busy, and one stage's steps (one engine thread) fit in the run's time, give or take the
    # step that straddles its start
    busy = run["stage_busy_ms_per_s"]
    assert all(0 < busy[s] < 1100.0 for s in stages.STAGES), busy
    # stage0 tells its steps apart: units started (front end and prefill pass) against decoded tokens only; the
    # two kinds make up every stage0 step of the run; `token` is every step that decoded tokens (the decode steps
    # and the prefill steps with tokens beside), counting its token rows only (P12)
    kinds = run["stage_step_ms_by_kind"]
    assert set(kinds) == {"stage0"} and set(kinds["stage0"]) == {"prefill", "decode", "token"}, kinds
    assert all(k["steps"] >= 1 and k["mean_ms"] > 0 and k["mean_rows"] >= 1 for k in kinds["stage0"].values()), kinds
    parts = [kinds["stage0"][k] for k in ("prefill", "decode")]
    steps = sum(k["steps"] for k in parts)
    mean = sum(k["steps"] * k["mean_ms"] for k in parts) / steps
    assert mean == pytest.approx(run["stage_step_ms"]["stage0"], rel=0.01), (kinds, run["stage_step_ms"])
    assert kinds["stage0"]["decode"]["steps"] <= kinds["stage0"]["token"]["steps"] < steps, kinds
    p12 = run["p12"]
    assert p12["token_rows_per_step"] == kinds["stage0"]["token"]["mean_rows"] and 0 < p12["speaking_sessions"] <= 2
    # speaking_sessions is rounded to 0.01 and the share to 0.001: on a loaded CI host 0.32 sessions made that 1.2 %
    assert p12["share"] == pytest.approx(p12["token_rows_per_step"] / p12["speaking_sessions"],
                                         rel=0.006 / p12["speaking_sessions"], abs=0.0006), p12
    assert "P12 token rows/speaking" in proc.stdout
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        sample = stages.parse(resp.read().decode())
    for stage in stages.STAGES:
        for family in stages.FAMILIES.values():
            assert sample[(f"{family}_count", stage)] > 0, (family, stage)
        assert sample[("duplex_stage_rows_per_step_sum", stage)] >= sample[("duplex_stage_rows_per_step_count", stage)]


def test_sessions_with_a_long_prompt_start_deep_and_still_answer(stack: Stack, tmp_path: Path) -> None:
    """--instructions-chars: each session's system prompt is that long (about one KV position per character with
    the tiny tokenizer), so the run's attention works at a long context; the gateway takes it, turns still answer."""
    out = tmp_path / "long.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "load_realtime.py"), "--url", f"ws://{stack.addr}",
                           "--sessions", "1", "--duration", "9", "--instructions-chars", "2000",
                           "--profile", str(PROFILE), "--out", str(out)],
                          capture_output=True, text=True, timeout=200, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["instructions_chars"] == 2000
    (run,) = doc["runs"]
    assert run["responses"] >= 1 and run["commit_to_first_audio_ms"]["p50"] is not None, run
    assert not run["errors"], run["errors"]
