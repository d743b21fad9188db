"""`ResponseHandle`: one assistant response as the client sees it (audio, transcript, terminal state)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from clients.events import AudioDelta, ResponseCreated, ResponseDone
from clients.stats import played_ms_at

AckSender = Callable[[dict[str, Any]], Awaitable[None]]


class ResponseHandle:
    """Fed by the client's reader; read by the application. `audio()` may be iterated any number of times.

    Audio ends at `response.output_audio.done`, at `output_audio_buffer.cleared` for this response (the
    client MUST stop playback at once, §8.4 B5), or at `response.done`.
    """

    def __init__(self, created: ResponseCreated, t: float, send: AckSender, clock: Callable[[], float]) -> None:
        self.created = created
        self.response_id = created.response_id
        self.created_t = t
        self.done: ResponseDone | None = None
        self.cleared_t: float | None = None
        self.sample_rate_hz = 24000
        self._chunks: list[bytes] = []
        self._recv_ms: list[float] = []
        self._dur_ms: list[float] = []
        self._text: list[str] = []
        self._audio_finished = False
        self._waiters: list[asyncio.Future[None]] = []
        self._send = send
        self._clock = clock

    # -- fed by the client ---------------------------------------------------------------------------
    def _on_audio(self, ev: AudioDelta, t: float) -> None:
        if self._audio_finished:
            return
        self.sample_rate_hz = ev.sample_rate_hz
        self._chunks.append(ev.pcm16)
        self._recv_ms.append(t * 1000.0)
        self._dur_ms.append(ev.duration_ms)
        self._notify()

    def _on_text(self, delta: str) -> None:
        self._text.append(delta)

    def _on_audio_end(self, t: float, *, cleared: bool = False) -> None:
        if cleared and self.cleared_t is None:
            self.cleared_t = t
        self._audio_finished = True
        self._notify()

    def _on_done(self, ev: ResponseDone, t: float) -> None:
        self.done = ev
        self._on_audio_end(t)

    def _notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def _changed(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    # -- application API -----------------------------------------------------------------------------
    @property
    def transcript(self) -> str:
        return "".join(self._text)

    @property
    def audio_ms(self) -> float:
        return sum(self._dur_ms)

    @property
    def cleared(self) -> bool:
        return self.cleared_t is not None

    def pcm16(self) -> bytes:
        return b"".join(self._chunks)

    async def audio(self) -> AsyncIterator[bytes]:
        """PCM16 chunks at `sample_rate_hz` as they arrive, until the audio of this response ends."""
        i = 0
        while True:
            while i < len(self._chunks):
                i += 1
                yield self._chunks[i - 1]
            if self._audio_finished:
                return
            await self._changed()

    async def wait_done(self, timeout: float | None = None) -> ResponseDone:  # noqa: ASYNC109
        async def _wait() -> ResponseDone:
            while self.done is None:
                await self._changed()
            return self.done
        return await asyncio.wait_for(_wait(), timeout)

    def played_ms(self, now: float | None = None) -> int:
        """Where a gapless real-time player started at the first chunk would be now (stopped at a clear)."""
        now = self._clock() if now is None else now
        if self.cleared_t is not None:
            now = min(now, self.cleared_t)
        return int(played_ms_at(now * 1000.0, self._recv_ms, self._dur_ms))

    def drained_at(self) -> float | None:
        """Monotonic time at which simulated playback of everything received ends (None before audio)."""
        if not self._recv_ms:
            return None
        end = 0.0
        for recv, dur in zip(self._recv_ms, self._dur_ms, strict=True):
            end = max(recv, end) + dur
        return end / 1000.0

    async def ack(self, played_ms: int | None = None, *, truncate: bool = False) -> None:
        """Send `playback.ack` (§7.2); by default the simulated played position."""
        position = self.played_ms() if played_ms is None else played_ms
        await self._send({"type": "playback.ack", "response_id": self.response_id, "played_ms": position,
                          "truncate": truncate})

    async def wait_drained(self) -> int:
        """Wait for the end of audio and of its simulated playback; return the played position in ms."""
        async for _ in self.audio():
            pass
        end = self.drained_at()
        if end is not None and self.cleared_t is None:
            await asyncio.sleep(max(0.0, end - self._clock()))
        return self.played_ms()
