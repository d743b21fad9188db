"""A simulated microphone for examples: a continuous 200 ms append stream (silence between utterances).

`say(pcm)` queues an utterance and returns once its last chunk is sent; the stream never pauses, like the
reference continuous client (§8.6 U-2), so the model keeps its units while the assistant talks.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from clients.audio import CHUNK_MS, INPUT_RATE, chunk_pcm16, read_wav, silence
from clients.client import DuplexClient


class SimulatedMic:
    def __init__(self, client: DuplexClient, speed: float = 1.0) -> None:
        self.client, self.speed = client, speed
        self._queue: asyncio.Queue[tuple[list[bytes], dict[str, Any], asyncio.Future[None]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SimulatedMic:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def say(self, pcm16: np.ndarray, **first_fields: Any) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put((list(chunk_pcm16(pcm16, INPUT_RATE, CHUNK_MS)), first_fields, done))
        await done

    async def _run(self) -> None:
        quiet = silence(CHUNK_MS).tobytes()
        period = CHUNK_MS / 1000.0 / self.speed
        next_t = self.client.clock()
        while not self.client.ended:
            if self._queue.empty():
                await self.client.append(quiet)
                next_t += period
                await asyncio.sleep(max(0.0, next_t - self.client.clock()))
                continue
            chunks, first_fields, done = self._queue.get_nowait()
            for i, chunk in enumerate(chunks):
                label = "overlap_speech" if i == 0 and first_fields else None
                label = "speech_end" if i == len(chunks) - 1 else label
                await self.client.append(chunk, label=label, **(first_fields if i == 0 else {}))
                next_t += period
                await asyncio.sleep(max(0.0, next_t - self.client.clock()))
            done.set_result(None)


def speech(text: str | None, wav: Path | None) -> np.ndarray:
    """A 16 kHz utterance from a WAV file, or synthesised from `text` with espeak-ng."""
    if wav is not None:
        return read_wav(wav, INPUT_RATE)[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "say.wav"
        subprocess.run(["espeak-ng", "-w", str(out), text or ""], check=True, capture_output=True)
        return read_wav(out, INPUT_RATE)[0]
