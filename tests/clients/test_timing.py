import base64
import random

import numpy as np
import pytest

from clients.events import parse_event
from clients.stats import played_ms_at, simulate_gapless_player, summarize
from clients.timing import EventCollector


def test_summarize_matches_numpy_linear_percentiles() -> None:
    xs = [random.Random(1).uniform(0, 100) for _ in range(37)]
    s = summarize(xs)
    assert s["count"] == 37
    assert s["p50"] == pytest.approx(np.percentile(xs, 50), abs=1e-3)
    assert s["p95"] == pytest.approx(np.percentile(xs, 95), abs=1e-3)
    assert s["mean"] == pytest.approx(np.mean(xs), abs=1e-3)
    assert summarize([]) == {"count": 0}


def _brute_underruns(recv, dur):
    """Independent reference: play sample-by-sample on a 1 ms grid and count silent ms after the start."""
    end_t = int(max(recv) + sum(dur)) + 2
    queue, gaps, cur = [], [], 0
    nxt = 0
    for t in range(int(recv[0]), end_t):
        while nxt < len(recv) and recv[nxt] <= t:
            queue.append(dur[nxt])
            nxt += 1
        if queue:
            if cur:
                gaps.append(cur)
            cur = 0
            queue[0] -= 1
            if queue[0] <= 0:
                queue.pop(0)
        elif nxt < len(recv):
            cur += 1
    return (max(gaps) if gaps else 0), sum(gaps)


def test_gapless_player_simulation_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(1, 8)
        recv = sorted(float(rng.randint(0, 4000)) for _ in range(n))
        dur = [float(rng.randint(100, 1000)) for _ in range(n)]
        ref_max, ref_total = _brute_underruns(recv, dur)
        got = simulate_gapless_player(recv, dur)
        assert (got.max_ms, got.total_ms) == (ref_max, ref_total)


def test_played_position() -> None:
    recv, dur = [0.0, 1500.0], [1000.0, 1000.0]
    assert played_ms_at(500, recv, dur) == 500
    assert played_ms_at(1200, recv, dur) == 1000  # underrun: waiting for chunk 2
    assert played_ms_at(1700, recv, dur) == 1200
    assert played_ms_at(9000, recv, dur) == 2000


def _delta(rid: str, ms: int, seq: int) -> dict:
    pcm = np.zeros(24 * ms, "<i2").tobytes()
    return {"type": "response.output_audio.delta", "server_event_seq": seq, "response_id": rid,
            "delta": base64.b64encode(pcm).decode(), "sample_rate_hz": 24000}


def _created(rid: str) -> dict:
    return {"type": "response.created", "response": {"id": rid, "duplex": {"trigger": "model"}}}


def _done(rid: str, status: str = "completed") -> dict:
    return {"type": "response.done", "response": {"id": rid, "status": status, "output": [],
                                                  "duplex": {"reason": "turn_end"}}}


def test_collector_commit_created_and_chunk_figures() -> None:
    c = EventCollector()
    c.on_send({"type": "input_audio_buffer.append"}, 0.9, "speech_end")
    c.on_send({"type": "input_audio_buffer.commit"}, 1.0)
    c.on_event(parse_event({"type": "input_audio_buffer.committed", "item_id": "u1", "metadata": {}}), 1.05)
    c.on_event(parse_event(_created("r1")), 1.4)
    c.on_event(parse_event(_delta("r1", 1000, 1)), 1.5)
    c.on_event(parse_event(_delta("r1", 500, 2)), 2.8)  # arrives 300 ms after the first chunk ran out
    c.on_event(parse_event(_done("r1")), 2.9)
    s = c.response_summary("r1")["client"]
    assert s["commit_to_first_audio_ms"] == pytest.approx(500.0)
    assert s["speech_end_to_first_audio_ms"] == pytest.approx(600.0)
    assert s["response_created_to_first_audio_ms"] == pytest.approx(100.0)
    assert s["max_chunk_gap_ms"] == pytest.approx(1300.0)
    assert s["max_underrun_ms"] == pytest.approx(300.0) and s["total_underrun_ms"] == pytest.approx(300.0)
    assert s["chunk_duration_ms"]["count"] == 2 and s["chunk_duration_ms"]["max"] == 1000.0


def test_commit_without_response_is_absent_and_cancel_latency() -> None:
    c = EventCollector()
    c.on_send({"type": "input_audio_buffer.commit"}, 1.0)
    c.on_event(parse_event({"type": "input_audio_buffer.committed", "item_id": "u1", "metadata": {}}), 1.1)
    c.on_send({"type": "input_audio_buffer.commit"}, 3.0)  # the model listened to the first: absent
    c.on_event(parse_event({"type": "input_audio_buffer.committed", "item_id": "u2", "metadata": {}}), 3.1)
    c.on_event(parse_event(_created("r2")), 3.3)
    c.on_event(parse_event(_delta("r2", 1000, 1)), 3.5)
    c.on_send({"type": "response.cancel"}, 4.0)
    c.on_event(parse_event(_delta("r2", 1000, 2)), 4.05)  # in flight when the cancel left
    c.on_event(parse_event({"type": "output_audio_buffer.cleared", "response_id": "r2"}), 4.1)
    c.on_event(parse_event(_done("r2", "cancelled")), 4.1)
    s = c.summary()
    assert len(s["responses"]) == 1
    client = s["responses"][0]["client"]
    assert client["commit_to_first_audio_ms"] == pytest.approx(500.0)  # from the second commit
    assert client["cancel_to_last_audio_ms"] == pytest.approx(50.0)


def test_events_without_a_created_response_are_ignored() -> None:
    c = EventCollector()
    c.on_event(parse_event(_delta("ghost", 1000, 1)), 1.0)
    assert c.summary()["responses"] == []
