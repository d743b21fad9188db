"""`DuplexClient` against the gateway (in-process with the reactive fake runtime, or DUPLEX_TEST_GATEWAY_URL)."""

import asyncio

import numpy as np
import pytest

from clients import DuplexClient
from clients.audio import silence
from clients.events import PlaybackAcknowledged
from tests.clients.conftest import speech_like

FAST = 8.0  # the fake runtime decides as soon as a unit is complete: stream faster than real time


def _utterance() -> np.ndarray:
    return np.concatenate([speech_like(1500), silence(2500)])


async def test_response_audio_transcript_and_playback_ack(gateway_url: str) -> None:
    async with DuplexClient(gateway_url) as c:
        assert c.session_id and c.created is not None
        if c.created.session["capabilities"]["supports_session_resume"]:
            assert c.created.resume_token
        await c.stream(_utterance(), speed=FAST)
        resp = await c.next_response(timeout=10)
        chunks = [chunk async for chunk in resp.audio()]
        done = await resp.wait_done(10)
        assert done.status == "completed" and chunks and resp.transcript
        assert b"".join(chunks) == resp.pcm16() and resp.audio_ms == 2000.0
        assert done.transcript == resp.transcript  # C-5: done transcript = joined deltas
        mark = c.mark()
        await resp.ack(1234)
        ack = await c.wait_for("playback.acknowledged", since=mark, timeout=5)
        assert isinstance(ack, PlaybackAcknowledged) and ack.played_ms == 1234
        summary = c.collector.summary()["responses"][0]
        assert summary["client"]["response_created_to_first_audio_ms"] >= 0
        assert summary["engine"]["0"]["units"] == 2
    assert c.ended and c.history[-1].type == "session.closed"
    assert not c.errors()


async def test_resume_after_a_dropped_socket_dedups_replay(gateway_url: str) -> None:
    async with DuplexClient(gateway_url) as c:
        if not c.created.session["capabilities"]["supports_session_resume"]:
            pytest.skip("this gateway does not advertise supports_session_resume yet")
        await c.stream(speech_like(1500), speed=FAST)
        await c.drop_connection()  # no session.close: the gateway detaches and journals
        await c.stream(silence(2500), speed=FAST)  # sends wait for the resume, then go out again
        resp = await c.next_response(timeout=10)
        await resp.wait_done(10)
        assert c.resumes == 1
        seqs = [ev.seq for ev in c.history if ev.seq is not None]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous, no duplicate, no hole
        assert [ev.type for ev in c.history].count("session.resumed") == 1


async def test_heartbeat_round_trip(gateway_url: str) -> None:
    async with DuplexClient(gateway_url, heartbeat_s=0.2) as c:
        await asyncio.sleep(0.6)
        assert c.heartbeat_rtt_ms is not None and c.heartbeat_rtt_ms >= 0
        assert any(e["event"]["type"] == "session.event_ack" for e in c.log if e["dir"] == "send") or c.seq.highest <= 1


async def test_native_route_gives_the_same_handles(gateway_url: str) -> None:
    async with DuplexClient(gateway_url, route="/v1/duplex") as c:
        await c.stream(_utterance(), speed=FAST)
        resp = await c.next_response(timeout=10)
        done = await resp.wait_done(10)
        assert done.status == "completed" and resp.audio_ms == 2000.0
        assert resp.transcript and resp.transcript == done.transcript
        assert all(ev.raw.get("type") != "response.output_audio_transcript.delta" for ev in c.history)
    assert not c.errors()
