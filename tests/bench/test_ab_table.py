"""bench/h200/ab_table.py: the served A/B's load JSONs as bench/RESULTS.md's table, a row per variant and level;
what an older JSON lacks reads "-"."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ab_table", REPO / "bench" / "h200" / "ab_table.py")
ab_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_table)

NEW = {"commit": "b5e49a2873e2", "profile": "deploy/profiles/ab-p0.yaml", "device": "cuda: NVIDIA H200", "runs": [
    {"sessions": 16, "held_realtime": True, "commit_to_first_audio_ms": {"p50": 251.4, "p99": 402.0},
     "stage_step_ms": {"stage0": 15.2, "tts": 60.0, "token2wav": 55.5},
     "stage_queue_wait_ms": {"stage0": 6.0, "tts": 19.0, "token2wav": 21.0},
     "stage_rows_per_step": {"stage0": 1.7, "tts": 1.3, "token2wav": 1.4},
     "stage_busy_ms_per_s": {"stage0": 550.0, "tts": 350.0, "token2wav": 400.0},
     "stage_step_ms_by_kind": {"stage0": {"prefill": {"steps": 300, "mean_rows": 1.5, "mean_ms": 24.0},
                                          "decode": {"steps": 700, "mean_rows": 1.83, "mean_ms": 11.4}}},
     "p12": {"token_rows_per_step": 2.1, "speaking_sessions": 7.5, "share": 0.28, "met": False},
     "first_unit_stages_ms": {"talker_own": {"p50": 64.6}, "code2wav_own": {"p50": 90.2}},
     "cancel_to_last_audio_ms": {"p50": 0.0, "p99": 3.0},
     "chunk_gap_ms": {"p50": 110.2, "p90": 1061.7, "p99": 1150.4, "over_bound": 0}, "max_chunk_gap_ms": 1190.6,
     "underruns": 121, "underrun_ms": 7282.8,
     "unit_to_audio_by_position_ms": {"1": {"p50": 240.4}, "2": {"p50": 280.0}, "3": {"p50": 331.2}},
     "unit_to_audio_step_ms": {"p50": 40.5, "p90": 86.1, "p99": 152.3, "over_200": 1},
     "unit_stages_by_position_ms": {"thinker_done": {"1": {"p50": 60.0}, "2": {"p50": 61.0}, "3": {"p50": 75.0}},
                                    "code2wav_first": {"1": {"p50": 200.0}, "2": {"p50": 250.0}}},
     "unit_step_sources_ms": {"big": {"count": 9, "step": 140.2, "stage0": 30.4, "tts": 2.0, "token2wav": 80.1,
                                      "rest": 27.7}},
     "gateway": {"cpu_share": 0.412, "loop_lag_ms": {"p50": 1.7, "p99": 42.0}}},
    {"sessions": 32, "held_realtime": False, "chunk_gap_ms": {"over_bound": 3}, "max_chunk_gap_ms": 1290.4}]}
OLD = {"commit": "02f129af7198", "runs": [{"sessions": 16, "held_realtime": True,
                                           "commit_to_first_audio_ms": {"p50": 249.4, "p99": 488.4}}]}


def test_a_row_per_variant_and_level_with_the_files_named_first(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "new.json").write_text(json.dumps(NEW))
    (tmp_path / "old.json").write_text(json.dumps(OLD))
    ab_table.main([f"p0={tmp_path / 'new.json'}", str(tmp_path / "old.json")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "- p0: commit b5e49a2873e2, profile deploy/profiles/ab-p0.yaml, cuda: NVIDIA H200"
    assert lines[1] == "- old: commit 02f129af7198, profile -, -"
    first, second = "\n".join(lines).split("\n\n")[1:]
    rows = [line.strip("| ").split(" | ") for line in first.splitlines() if "---" not in line][1:]
    head = list(ab_table.COLUMNS)
    p16, p32, old = (dict(zip(head, r, strict=True)) for r in rows)
    assert (p16["variant"], p16["N"], p16["held"], p16["commit->first audio p50 / p99"]) == ("p0", "16", "yes", "251 / 402")
    assert p16["s0 prefill / decode step ms"] == "24.0 / 11.4" and p16["s0 rows per decode step"] == "1.83"
    assert p16["s0 prefill / decode steps"] == "300 / 700" and old["s0 prefill / decode steps"] == "- / -"
    assert p16["P12 token rows / speaking"] == "2.10 / 7.50 = 0.28" and old["P12 token rows / speaking"] == "-"
    assert p16["step ms s0 / tts / t2w"] == "15.2 / 60.0 / 55.5" and p16["rows/step s0 / tts / t2w"] == "1.70 / 1.30 / 1.40"
    assert p16["talker_own / code2wav_own p50"] == "65 / 90" and p16["cancel->last audio p50 / p99"] == "0 / 3"
    assert p32["held"] == "NO (3 gaps over 1.2 s, max 1290)" and p32["commit->first audio p50 / p99"] == "- / -"
    assert (old["variant"], old["commit->first audio p50 / p99"], old["s0 prefill / decode step ms"]) == (
        "old", "249 / 488", "- / -")
    positions = [dict(zip(ab_table.POSITION_COLUMNS, line.strip("| ").split(" | "), strict=True))
                 for line in second.splitlines() if "---" not in line][1:]
    assert [(p["variant"], p["N"]) for p in positions] == [("p0", "16"), ("p0", "32"), ("old", "16")]
    assert positions[0]["chunk gap p90 / p99 / max"] == "1062 / 1150 / 1191"
    assert positions[0]["underruns (s)"] == "121 (7.3)" and positions[2]["underruns (s)"] == "- (-)"
    assert positions[1]["chunk gap p90 / p99 / max"] == "- / - / 1290"
    assert positions[0]["unit->audio p50 by position 1 / 2 / 3"] == "240 / 280 / 331"
    assert positions[0]["unit step p50 / p90 / p99 (over 200)"] == "40 / 86 / 152 (1)"
    assert positions[0]["s0 done p50 by position"] == "60 / 61 / 75"
    assert positions[0]["first TTS codes p50 by position"] == "- / - / -"
    assert positions[0]["first audio (gateway) p50 by position"] == "200 / 250 / -"
    assert positions[2]["unit step p50 / p90 / p99 (over 200)"] == "- / - / - (-)"
    assert positions[0]["top-tenth unit step ms: s0 / tts / t2w / rest"] == "140: 30 / 2 / 80 / 28"
    assert positions[2]["top-tenth unit step ms: s0 / tts / t2w / rest"] == "-: - / - / - / -"
    assert positions[0]["gateway CPU share, loop lag p50 / p99 ms"] == "0.41, 1.7 / 42.0"
    assert positions[2]["gateway CPU share, loop lag p50 / p99 ms"] == "-, - / -"
