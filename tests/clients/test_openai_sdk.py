"""The official `openai` SDK's realtime client, unmodified, against `/v1/realtime` (protocol.md §3.11)."""

import asyncio
import base64

import numpy as np
import pytest

from clients.audio import resample, silence
from tests.clients.conftest import speech_like

openai = pytest.importorskip("openai")

SDK_RATE = 24000  # an unmodified OpenAI client streams undeclared 24 kHz PCM (§2.3, OA-4)
CHUNK_MS = 200


async def test_openai_realtime_client_receives_audio_deltas(gateway_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused") as client:
        models = await client.models.list()
        await _converse(client, models.data[0].id)


async def _converse(client, model: str) -> None:
    audio = resample(np.concatenate([speech_like(1500), silence(2500)]), 16000, SDK_RATE)
    step = SDK_RATE * CHUNK_MS // 1000
    seen: list[str] = []
    deltas: list[bytes] = []
    async with client.realtime.connect(model=model) as conn:
        first = await asyncio.wait_for(conn.recv(), 10)
        assert first.type == "session.created"
        for start in range(0, len(audio), step):
            await conn.input_audio_buffer.append(audio=base64.b64encode(audio[start:start + step].tobytes()).decode())

        async def receive() -> None:
            async for event in conn:
                seen.append(event.type)
                if event.type == "response.output_audio.delta":
                    deltas.append(base64.b64decode(event.delta))
                if event.type == "response.done":
                    assert event.response.status == "completed"
                    return

        await asyncio.wait_for(receive(), 20)
    assert deltas and sum(len(d) for d in deltas) == 2 * SDK_RATE * 2  # two 1 s units of 24 kHz PCM16
    assert "response.created" in seen and "response.output_audio_transcript.delta" in seen
