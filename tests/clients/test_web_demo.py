"""The demo page in headless Debian Chromium with a fake microphone fed from a WAV file."""

import asyncio
import shutil
import subprocess

import numpy as np
import pytest

from clients.audio import read_wav, resample, silence, write_wav
from tests.clients import cdp
from tests.clients.conftest import speech_like
from tests.clients.reactive_runtime import ReactiveRuntime

pytestmark = pytest.mark.skipif(not cdp.available(), reason="Debian chromium is not installed")
MIC_RATE = 48000
DEMO = "window.__duplexDemo"


def _fake_mic_wav(tmp_path):
    """Speech then 2.5 s of silence (Chromium loops the file), as 48 kHz PCM16."""
    if shutil.which("espeak-ng"):
        raw = tmp_path / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(raw), "Hello, what is the weather like today?"], check=True)
        speech = read_wav(raw, 16000)[0]
    else:
        speech = speech_like(1500)
    pcm = np.concatenate([speech, silence(2500)])
    return write_wav(tmp_path / "mic.wav", resample(pcm, 16000, MIC_RATE), MIC_RATE)


async def test_demo_page_runs_a_session(gateway_url: str, runtime: ReactiveRuntime, tmp_path, artifacts) -> None:
    async with cdp.launch(_fake_mic_wav(tmp_path)) as page:
        await page.navigate(f"{gateway_url}/")
        assert await page.evaluate("document.title") == "MiniCPM-o 4.5 · Full-duplex voice"
        sources = await page.evaluate("[...document.scripts, ...document.querySelectorAll('link')]"
                                      ".map(e => e.src || e.href)")
        assert sources and all(s.startswith(gateway_url) for s in sources)  # no external CDN
        await page.evaluate("document.getElementById('camera').checked = true;"
                            "document.getElementById('start').click()")
        try:
            await _first_reply_is_played_and_acked(page)
            await _interrupt_truncates_playback(page, runtime)
            await _mute_stops_uploads(page)
        finally:
            await page.screenshot(artifacts / "web_demo.png")
        demo = await page.evaluate(DEMO)
        assert demo["errors"] == [], (demo["errors"], page.console)
        assert not [line for line in page.console if line.startswith("EXCEPTION")], page.console
        assert demo["framesSent"] >= 1  # camera frames ride the appends that close a unit
        await page.evaluate("document.getElementById('stop').click()")
        await page.wait_for(f"{DEMO}.state === 'idle'", timeout=5)


async def _first_reply_is_played_and_acked(page: cdp.Page) -> None:
    await page.wait_for(f"{DEMO}.acks.length > 0", timeout=30)
    demo = await page.evaluate(DEMO)
    assert demo["audioChunks"] >= 2 and demo["appends"] >= 10
    ack = demo["acks"][0]
    assert ack["type"] == "playback.ack" and not ack["truncate"]
    assert ack["played_ms"] == pytest.approx(demo["responses"][ack["response_id"]]["audio_ms"], abs=50)
    await page.wait_for("document.getElementById('fig-played').textContent !== '—'", timeout=5)
    assert 0 < demo["speechEndToFirstAudioMs"] < 10000  # the fake answers one silent unit after the speech
    transcript = await page.evaluate("document.getElementById('transcript').innerText")
    assert demo["responses"][ack["response_id"]]["transcript"].strip() in transcript


async def _interrupt_truncates_playback(page: cdp.Page, runtime: ReactiveRuntime) -> None:
    runtime.answer_units = 6  # the next answer is long enough to interrupt
    await page.wait_for(f"{DEMO}.state === 'speaking' && Object.values({DEMO}.responses).length === 2 && "
                        f"Object.values({DEMO}.responses)[1].audio_ms >= 2000", timeout=30)
    await page.evaluate("document.getElementById('interrupt').click()")
    ack = await page.wait_for(f"{DEMO}.acks.find(a => a.truncate)", timeout=10)
    assert 500 < ack["played_ms"] < 6000  # stopped mid-answer, after the first chunk started playing
    await page.wait_for(f"document.getElementById('t-{ack['response_id']}').innerText.includes('cancelled')",
                        timeout=5)


async def _mute_stops_uploads(page: cdp.Page) -> None:
    await page.evaluate("document.getElementById('mute').click()")
    before = await page.evaluate(f"{DEMO}.appends")
    await asyncio.sleep(0.8)
    assert await page.evaluate(f"{DEMO}.appends") <= before + 1  # at most one chunk already in flight
    await page.evaluate("document.getElementById('mute').click()")
    await page.wait_for(f"{DEMO}.appends > {before + 2}", timeout=5)
