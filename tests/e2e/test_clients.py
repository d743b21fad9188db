"""Issue 8 through the real stack: DuplexClient, the unmodified `openai` SDK, and the web demo in Chromium."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from clients import DuplexClient
from clients.audio import read_wav, resample, silence, write_wav
from tests.clients import cdp
from tests.clients.test_e2e_real_stack import (
    test_spoken_question_through_the_real_stack as duplex_client_scenario,
)
from tests.e2e.stack import Stack, profile_engine

pytestmark = pytest.mark.e2e

LOOPBACK = profile_engine().endswith("loopback")
SDK_RATE = 24000  # an unmodified OpenAI client streams undeclared 24 kHz PCM16 (§2.3)
CHUNK_MS = 200
MIC_RATE = 48000
DEMO = "window.__duplexDemo"
SDK_LOUD_MS = 5000  # > force_listen_count (3) units of loud audio, so a model that speaks on sound can answer


@pytest.mark.timeout(120)
async def test_duplex_client_scenario_from_tests_clients(stack: Stack, tmp_path: Path) -> None:
    """tests/clients' real-stack scenario (normally run with DUPLEX_TEST_GATEWAY_URL), unchanged, against our stack."""
    if not LOOPBACK:
        pytest.skip("the scenario waits up to 60 s for each response to end; the tiny random checkpoint never "
                    "samples <|turn_eos|>, so its responses end only on cancel/close (see the next test)")
    await duplex_client_scenario(stack.url, tmp_path)


@pytest.mark.timeout(120)
async def test_duplex_client_spoken_question_cancel_and_close(stack: Stack, tmp_path: Path) -> None:
    """DuplexClient: a spoken question, the model's decisions, open responses cancelled and acked, a clean close."""
    question = _speech_16k(tmp_path, "What is the capital of France?")
    loud = np.tile(question, 3)  # > force_listen_count units of speech, so a model that speaks on sound can
    async with DuplexClient(stack.url) as c:
        await c.stream(np.concatenate([loud, silence(500)]), speed=2.0, last_label="speech_end")
        await c.commit()
        await c.stream(silence(2000), speed=2.0)
        await asyncio.sleep(1.0)
        kinds = [ev.type for ev in c.history]
        assert "response.listen" in kinds or "response.created" in kinds, kinds
        for resp in list(c.responses.values()):
            if resp.audio_ms:
                await resp.ack(int(resp.audio_ms))
                timing = c.collector.response_summary(resp.response_id)
                assert timing["client"]["response_created_to_first_audio_ms"] >= 0
            if resp.done is None:  # still open (the tiny model never ends its turn; the loopback neither)
                await c.cancel(resp.response_id)
            done = await resp.wait_done(20)
            assert done.status in ("completed", "cancelled")
        if LOOPBACK:
            assert any(r.audio_ms > 0 and r.transcript for r in c.responses.values())
        assert not c.errors(), [e.raw for e in c.errors()]
    assert c.history[-1].type == "session.closed"


def _speech_16k(tmp_path: Path, text: str) -> np.ndarray:
    if not shutil.which("espeak-ng"):
        pytest.skip("espeak-ng is not installed")
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True, capture_output=True)
    return read_wav(wav, 16000)[0]


async def test_openai_sdk_realtime_receives_audio_deltas(stack: Stack, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    speech = _speech_16k(tmp_path, "Hello, what is the weather like today in Paris?")
    loud = np.tile(speech, int(np.ceil(16000 * SDK_LOUD_MS / 1000 / len(speech))))[: 16000 * SDK_LOUD_MS // 1000]
    audio = resample(np.concatenate([loud, silence(1000)]), 16000, SDK_RATE)
    step = SDK_RATE * CHUNK_MS // 1000
    seen: list[str] = []
    deltas: list[bytes] = []
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused") as client:
        model = (await client.models.list()).data[0].id
        async with client.realtime.connect(model=model) as conn:
            first = await asyncio.wait_for(conn.recv(), 30)
            assert first.type == "session.created"
            for start in range(0, len(audio), step):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[start:start + step].tobytes()).decode())

            async def receive() -> None:
                async for event in conn:
                    seen.append(event.type)
                    if event.type == "response.output_audio.delta":
                        deltas.append(base64.b64decode(event.delta))
                        if sum(map(len, deltas)) >= 2 * SDK_RATE // 10:
                            return
                    if event.type == "response.done" and deltas:
                        return
                    assert event.type != "error", event

            try:
                await asyncio.wait_for(receive(), 30)
            except TimeoutError:
                if LOOPBACK:
                    raise
                assert "response.listen" in seen, seen  # the model decided its units, and chose to listen
                pytest.skip("the tiny random model did not speak")
    assert "response.created" in seen and deltas and all(d and len(d) % 2 == 0 for d in deltas)  # no empty delta
    # at least 100 ms of 24 kHz PCM16 from the first deltas: a unit's left pad (§6.6) may go out alone before its
    # vocoder audio, as a shorter first delta
    assert sum(map(len, deltas)) >= 2 * SDK_RATE // 10


def _fake_mic_wav(tmp_path: Path) -> Path:
    """Speech then 2.5 s of silence (Chromium loops the file), as 48 kHz PCM16."""
    speech = _speech_16k(tmp_path, "Hello, what is the weather like today?")
    pcm = np.concatenate([speech, silence(2500)])
    return write_wav(tmp_path / "mic.wav", resample(pcm, 16000, MIC_RATE), MIC_RATE)


@pytest.mark.skipif(not cdp.available(), reason="Debian chromium is not installed")
@pytest.mark.timeout(120)
async def test_web_demo_in_headless_chromium(stack: Stack, tmp_path: Path) -> None:
    async with cdp.launch(_fake_mic_wav(tmp_path)) as page:
        await page.navigate(f"{stack.url}/")
        assert await page.evaluate("document.title") == "MiniCPM-o 4.5 · Full-duplex voice"
        sources = await page.evaluate("[...document.scripts, ...document.querySelectorAll('link')]"
                                      ".map(e => e.src || e.href)")
        assert sources and all(s.startswith(stack.url) for s in sources)  # served by the gateway, no CDN
        await page.evaluate("document.getElementById('start').click()")
        try:
            await page.wait_for(f"{DEMO}.appends >= 10 && {DEMO}.sessionId", timeout=60)
            try:
                await page.wait_for(f"{DEMO}.audioChunks >= 2 && {DEMO}.state === 'speaking'", timeout=40)
                spoke = True
            except TimeoutError:
                if LOOPBACK:
                    raise
                spoke = False
            if spoke:  # interrupt the answer: playback truncated, the response cancelled
                await page.evaluate("document.getElementById('interrupt').click()")
                ack = await page.wait_for(f"{DEMO}.acks.find(a => a.truncate)", timeout=15)
                assert ack["played_ms"] >= 0
                await page.wait_for(f"document.getElementById('t-{ack['response_id']}').innerText"
                                    ".includes('cancelled')", timeout=10)
        finally:
            await page.screenshot(tmp_path / "web_demo_real_stack.png")
        demo = await page.evaluate(DEMO)
        assert demo["errors"] == [], (demo["errors"], page.console)
        assert not [line for line in page.console if line.startswith("EXCEPTION")], page.console
        await page.evaluate("document.getElementById('stop').click()")
        await page.wait_for(f"{DEMO}.state === 'idle'", timeout=10)
