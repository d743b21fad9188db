"""`duplex talk` and `clients/examples/barge_in.py` against the gateway."""

import json
import wave

import numpy as np

from clients.audio import write_wav
from clients.cli import build_parser, run_talk, talk_main
from clients.examples import barge_in
from tests.clients.conftest import speech_like
from tests.clients.reactive_runtime import ReactiveRuntime


def _wav(path, ms: int, freq: float = 220.0):
    return write_wav(path, speech_like(ms, 16000, freq=freq), 16000)


async def test_talk_streams_a_file_and_saves_the_reply(gateway_url: str, tmp_path, capsys) -> None:
    question = _wav(tmp_path / "question.wav", 1500)
    args = build_parser().parse_args(["--wav", str(question), "--url", gateway_url, "--out-dir",
                                      str(tmp_path / "out"), "--speed", "4", "--tail-s", "0.5",
                                      "--summary-json", str(tmp_path / "summary.json")])
    summary = await run_talk(args)
    out = capsys.readouterr().out
    assert summary["responses"] and summary["files"]
    with wave.open(summary["files"][0]) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (24000, 1, 48000)
    r = summary["responses"][0]
    assert r["status"] == "completed" and r["transcript"] in out
    assert "commit_to_first_audio_ms" in r["client"] and "commit_to_first_audio_ms" in out
    assert json.loads((tmp_path / "summary.json").read_text())["session_id"] == summary["session_id"]


def test_talk_main_reports_a_missing_file() -> None:
    assert talk_main(["--wav", "/nonexistent/question.wav", "--url", "http://127.0.0.1:9"]) == 1


async def test_barge_in_example(gateway_url: str, runtime: ReactiveRuntime, tmp_path, artifacts) -> None:
    runtime.answer_units = 4  # long enough to still be generating when the interruption comes
    wavs = {name: _wav(tmp_path / f"{name}.wav", ms, freq) for name, ms, freq in
            (("greet", 800, 200.0), ("ask", 1200, 240.0), ("interrupt", 1000, 280.0))}
    out = artifacts / "barge_in"  # kept: WAVs, summary.json and events.jsonl of the last run
    args = barge_in.build_parser().parse_args(
        ["--url", gateway_url, "--out-dir", str(out), "--interrupt-after-ms", "800",
         *[x for name, p in wavs.items() for x in (f"--{name}-wav", str(p))]])
    summary = await barge_in.run(args)
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["ask"]["status"] == "cancelled" and steps["ask"]["reason"] == "barge_in"
    assert 800 <= steps["ask"]["played_ms"] < 4000
    assert steps["second_answer"]["played_ms"] == 4000 and steps["greet"]["played_ms"] == 4000
    assert not summary["errors"]
    for name in ("greeting_reply.wav", "answer_interrupted.wav", "second_answer.wav", "summary.json"):
        assert (out / name).exists()
    log = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    acks = [e["event"] for e in log if e["dir"] == "send" and e["event"]["type"] == "playback.ack"]
    assert [a["truncate"] for a in acks] == [False, True, False]
    recv = [e["event"]["type"] for e in log if e["dir"] == "recv"]
    assert recv.count("playback.acknowledged") == 3 and "output_audio_buffer.cleared" in recv
    assert recv[-1] == "session.closed"
    answer = summary["timings"]["responses"][1]
    assert answer["client"]["cancel_to_last_audio_ms"] >= 0
    assert np.isfinite(answer["audio_ms"])


def test_duplex_console_script_dispatches_talk(capsys) -> None:
    from serve.cli import main

    assert main(["talk", "--wav", "/nonexistent/question.wav", "--url", "http://127.0.0.1:9"]) == 1
    assert main([]) == 2 and "talk" in capsys.readouterr().out
