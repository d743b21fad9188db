"""server_vad (§8.1, §8.2) and barge-in (§8.3 O4, §8.4 B2/B3) through the real gateway, on espeak-ng speech."""

from __future__ import annotations

import base64
import shutil

import numpy as np
import pytest
import websockets

from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import serve
from tests.gateway_ops.test_wired_resume import stream
from tests.gateway_ops.wire import Raw, http_get, metric, opened

RATE = 16000
CHUNK_MS = 200
PCM16_MAX = 32767
VAD_ON = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


def silence(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, np.float32)


async def send_audio(c: Raw, x: np.ndarray, **extra: object) -> None:
    step = RATE * CHUNK_MS // 1000
    for i in range(0, len(x), step):
        pcm = (np.clip(x[i:i + step], -1, 1) * PCM16_MAX).astype("<i2").tobytes()
        await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode(),
                      "sample_rate_hz": RATE, **extra})


async def vad_session(addr: str) -> Raw:
    c, _ = await opened(addr)
    await c.send({"type": "session.update", "session": {"turn_detection": VAD_ON}})
    updated = await c.until("session.updated")
    assert updated["session"]["turn_detection"]["type"] == "server_vad"
    assert updated["session"]["overlap_policy"] == "barge_in_on_speech"  # §8.1: VAD forces the policy
    return c


async def scenario_vad_speech_vs_silence(addr: str, speech: np.ndarray) -> None:
    c = await vad_session(addr)
    lead_ms = 1000
    await send_audio(c, np.concatenate([silence(lead_ms), speech, silence(1200)]))
    started = await c.until("input_audio_buffer.speech_started")
    stopped = await c.until("input_audio_buffer.speech_stopped")
    committed = await c.until("input_audio_buffer.committed")  # the auto-commit (Q1-Q4) after the stop
    speech_ms = len(speech) * 1000 / RATE
    assert started["metadata"]["source"] == "server_vad" and stopped["metadata"]["source"] == "server_vad"
    assert lead_ms - VAD_ON["prefix_padding_ms"] <= started["audio_start_ms"] <= lead_ms + 400
    assert lead_ms + speech_ms - 600 <= stopped["audio_end_ms"] <= lead_ms + speech_ms + 100
    assert committed["item_id"] == started["item_id"] == stopped["item_id"]
    await c.send({"type": "session.close"})
    await c.until("session.closed")
    await c.ws.close()


async def test_vad_on_speech_vs_silence(speech: np.ndarray) -> None:
    async with serve(FakeRuntime()) as addr:
        await scenario_vad_speech_vs_silence(addr, speech)
        c = await vad_session(addr)  # silence alone: no speech events, no commit
        await send_audio(c, silence(3000))
        await c.quiet(0.5)
        kinds = {e["type"] for e in c.events}
        assert not kinds & {"input_audio_buffer.speech_started", "input_audio_buffer.committed"}
        await c.ws.close()


async def test_vad_barge_in_cancels_a_speaking_response(speech: np.ndarray) -> None:
    rt = FakeRuntime()
    for u in range(1, 12):
        rt.plan[u] = Speak("talking ", 1000)
    async with serve(rt) as addr:
        c = await vad_session(addr)
        await stream(c, 2)  # tones at 16 kHz: the VAD hears no speech in them
        await c.until("response.output_audio.delta")
        await send_audio(c, speech[: RATE // 2])
        decision = await c.until("overlap.decision")
        assert (decision["action"], decision["reason"]) == ("barge_in", "server_vad_utterance_active")
        done = await c.until("response.done")
        assert done["response"]["duplex"]["reason"] == "turn_detected"
        assert "output_audio_buffer.cleared" in [e["type"] for e in c.events]
        assert any(op == "cancel" for op, _ in rt.ops)  # B2: the runtime cancel
        await c.ws.close()
        text = (await http_get(addr, "/metrics")).text
    assert metric(text, "duplex_barge_in_total", source="vad") == 1


async def test_barge_in_on_a_finished_but_still_playing_response(speech: np.ndarray) -> None:
    """B3: the response finished generating; speech during its playback clears it and truncates history."""
    rt = FakeRuntime()
    rt.plan[1] = Speak("a complete short answer ", 1000, end_of_turn=True)
    async with serve(rt) as addr:
        c = await vad_session(addr)
        await stream(c, 2)
        done = await c.until("response.done")
        await send_audio(c, speech[: RATE // 2])  # within the playback estimate (sent + 1.5 s)
        decision = await c.until("overlap.decision")
        cleared = await c.until("output_audio_buffer.cleared")
        truncated = await c.until("conversation.item.truncated")
        assert decision["action"] == "barge_in" and decision["response_id"] == done["response"]["id"]
        assert cleared["response_id"] == done["response"]["id"]
        assert truncated["item_id"] == done["response"]["output"][0]["id"]
        assert not any(op == "cancel" for op, _ in rt.ops)  # B3: no epoch change, no runtime call
        await c.ws.close()


async def test_overlap_episode_survives_the_end_of_generation() -> None:
    """§8.3: the episode ends when the assistant becomes inactive, not when generation ends (still playing)."""
    from tests.gateway.harness import append  # noqa: PLC0415

    rt = FakeRuntime()
    rt.plan[1] = Speak("first ", 1000)
    rt.plan[2] = Speak("last ", 1000, end_of_turn=True)
    async with serve(rt) as addr:
        c, _ = await opened(addr)
        await c.send({"type": "session.update", "session": {"overlap_policy": "auto"}})
        await c.until("session.updated")
        await stream(c, 2)
        await c.until("response.output_audio.delta")
        for _ in range(4):  # 800 ms of overlapping speech while generating: listen, overlap pending
            await c.send(append(CHUNK_MS))
        await c.until("response.done")  # generation ends; playback goes on
        for _ in range(2):  # 400 ms more: 1200 ms in one episode -> barge-in on the playing response
            await c.send(append(CHUNK_MS))
        decision = await c.until("overlap.decision")
        while decision["action"] != "barge_in":
            decision = await c.until("overlap.decision")
        assert decision["reason"] == "long_overlap_speech" and decision["metadata"]["overlap_ms"] >= 1200
        await c.until("output_audio_buffer.cleared")
        await c.ws.close()


async def test_vad_from_the_opener_and_turned_off_again(speech: np.ndarray) -> None:
    async with serve(FakeRuntime()) as addr:
        c = Raw(await websockets.connect(f"ws://{addr}/v1/realtime?autostart=0"))
        await c.send({"type": "session.update", "session": {"turn_detection": VAD_ON}})
        await c.until("session.updated")
        await send_audio(c, np.concatenate([silence(400), speech[: RATE]]))
        started = await c.until("input_audio_buffer.speech_started")
        assert started["metadata"]["source"] == "server_vad"
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("input_audio_buffer.committed")
        await c.send({"type": "session.update", "session": {"turn_detection": None}})
        off = await c.until("session.updated")
        assert off["session"]["turn_detection"] is None
        await send_audio(c, speech[: RATE])  # VAD off: the RMS path classifies (§8.2 priority 3)
        again = await c.until("input_audio_buffer.speech_started")
        assert again["metadata"]["source"] == "rms"
        await c.ws.close()
