"""`DuplexClient`: an async client for the gateway's full-duplex sessions (`/v1/realtime` ga, or `/v1/duplex`).

One reader task owns the receive side (parse -> dedup by `server_event_seq` -> collector -> inbox); one
maintenance task sends `session.event_ack` (J-2) and heartbeats. When the socket drops without
`session.closed`, the reader resumes the session (§6.4) and drops the replayed duplicates (J-6).

    async with DuplexClient("http://127.0.0.1:8000") as c:
        await c.stream(pcm16, 16000)                  # real-time 200 ms appends
        resp = await c.next_response(timeout=30)
        async for chunk in resp.audio(): ...          # 24 kHz PCM16 as it arrives
        await resp.ack()                              # playback.ack
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import websockets
from websockets.exceptions import ConnectionClosed

from clients.audio import CHUNK_MS, INPUT_RATE, chunk_pcm16
from clients.connection import DEFAULT_SESSION, DuplexError, open_session, resume_session
from clients.events import HeartbeatAck, SessionCreated, SessionEnded, parse_event
from clients.inbox import Inbox
from clients.resume import FINAL_RESUME_CODES, ResumeCredentials, SeqTracker, backoff_delays
from clients.timing import EventCollector, SendLabel

HEARTBEAT_S = 10.0
MAINTENANCE_TICK_S = 0.1
CLOSE_TIMEOUT_S = 15.0
LOGGED_PAYLOADS = ("audio", "video_frames")  # elided from the event log: only their size is kept


class DuplexClient(Inbox):
    def __init__(self, base_url: str, *, route: str = "/v1/realtime", session: dict[str, Any] | None = None,
                 heartbeat_s: float = HEARTBEAT_S, auto_resume: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(self.send, clock)
        self.base_url, self.route = base_url, route
        self.session_config = session if session is not None else DEFAULT_SESSION
        self.heartbeat_s, self.auto_resume, self.clock = heartbeat_s, auto_resume, clock
        self.collector = EventCollector()
        self.seq = SeqTracker()
        self.log: list[dict[str, Any]] = []  # {t, dir, event}: the events.jsonl record
        self.created: SessionCreated | None = None
        self.heartbeat_rtt_ms: float | None = None
        self.resumes = 0
        self.failure: DuplexError | None = None  # why the session was lost, if a resume failed
        self._creds: ResumeCredentials | None = None
        self._ws: websockets.ClientConnection | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self._heartbeat_sent_t: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ----------------------------------------------------------------------------------
    async def connect(self) -> SessionCreated:
        self._ws, created = await open_session(self.base_url, self.route, self.session_config)
        self._process(created.raw)
        self._connected.set()
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._maintenance())]
        return created

    async def __aenter__(self) -> DuplexClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session_id(self) -> str | None:
        return self.created.session_id if self.created else None

    async def close(self, reason: str | None = None, timeout: float = CLOSE_TIMEOUT_S) -> None:  # noqa: ASYNC109
        """Graceful close (§3.10): `session.close`, wait for `session.closed`, then stop the tasks."""
        if not self.ended and self._connected.is_set():
            self._closing = True
            with contextlib.suppress(ConnectionClosed, TimeoutError, DuplexError):
                await self.send({"type": "session.close", **({"reason": reason} if reason else {})})
                await asyncio.wait_for(self._reader_done(), timeout)
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await self._ws.close()

    async def _reader_done(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._tasks[0]

    async def drop_connection(self) -> None:
        """Abort the socket without `session.close` (for tests and demos of resume)."""
        if self._ws is not None:
            self._ws.transport.abort()

    # -- sending ------------------------------------------------------------------------------------
    async def send(self, frame: dict[str, Any], label: SendLabel | None = None) -> None:
        """Write one frame; while a resume is in progress, wait for it and write on the new socket."""
        while True:
            if self.ended:
                raise DuplexError(f"session ended; cannot send {frame.get('type')}")
            await asyncio.wait_for(self._connected.wait(), CLOSE_TIMEOUT_S)
            ws = self._ws
            assert ws is not None
            try:
                await ws.send(json.dumps(frame))
                break
            except ConnectionClosed:
                if not self.auto_resume or self._creds is None:
                    raise
                if self._ws is ws:
                    self._connected.clear()  # the reader resumes; the frame was not written: send it again
        t = self.clock()
        self.collector.on_send(frame, t, label)
        logged = {k: (f"<{len(v)} chars>" if k in LOGGED_PAYLOADS else v) for k, v in frame.items()}
        self.log.append({"t": round(t, 6), "dir": "send", "event": logged})

    async def append(self, pcm16: bytes, *, sample_rate_hz: int = INPUT_RATE, label: SendLabel | None = None,
                     **fields: Any) -> None:
        await self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode(),
                         "sample_rate_hz": sample_rate_hz, **fields}, label)

    async def stream(self, pcm16: np.ndarray, rate: int = INPUT_RATE, *, chunk_ms: int = CHUNK_MS,
                     speed: float = 1.0, last_label: SendLabel | None = None, **first_fields: Any) -> None:
        """Append `pcm16` in `chunk_ms` pieces on an absolute real-time grid (`speed` > 1 runs faster)."""
        chunks = list(chunk_pcm16(pcm16, rate, chunk_ms))
        t0 = self.clock()
        for i, chunk in enumerate(chunks):
            delay = t0 + i * chunk_ms / 1000.0 / speed - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            label = last_label if i == len(chunks) - 1 else None
            await self.append(chunk, sample_rate_hz=rate, label=label, **(first_fields if i == 0 else {}))

    async def commit(self, **fields: Any) -> None:
        await self.send({"type": "input_audio_buffer.commit", **fields})

    async def cancel(self, response_id: str | None = None) -> None:
        await self.send({"type": "response.cancel", **({"response_id": response_id} if response_id else {})})

    # -- receiving ----------------------------------------------------------------------------------
    def _process(self, raw: dict[str, Any]) -> None:
        ev = parse_event(raw)
        if not self.seq.accept(ev.seq):
            return  # a replayed event already processed (J-6)
        t = self.clock()
        self.log.append({"t": round(t, 6), "dir": "recv", "event": raw})
        self.collector.on_event(ev, t)
        if isinstance(ev, SessionCreated):
            self.created = self.created or ev
            if ev.resume_token:
                self._creds = ResumeCredentials(ev.session_id, ev.resume_token, ev.incarnation)
        elif isinstance(ev, HeartbeatAck) and self._heartbeat_sent_t is not None:
            self.heartbeat_rtt_ms = round((t - self._heartbeat_sent_t) * 1000.0, 3)
        elif isinstance(ev, SessionEnded) and ev.type == "session.resync_required":
            self._creds = None  # discard the resume token: the next disconnect ends the session (CL-2)
        self.add(ev, t)
        if isinstance(ev, SessionEnded) and ev.type != "session.resync_required":
            self.end()  # closed / expired / replaced: the session is gone, this client is done (CL-4)

    async def _reader(self) -> None:
        try:
            while not self.ended:
                ws = self._ws
                assert ws is not None
                with contextlib.suppress(ConnectionClosed):
                    async for message in ws:
                        if isinstance(message, str):
                            self._process(json.loads(message))
                self._connected.clear()
                if self.ended or self._closing or not self.auto_resume or self._creds is None:
                    return
                try:
                    await self._resume()
                except DuplexError as exc:
                    self.failure = exc  # a final code, or retries exhausted (CL-3): the session is lost to us
                    return
        finally:
            self.end()

    async def _resume(self) -> None:
        assert self._creds is not None
        last_error: DuplexError | None = None
        for delay in [0.0, *backoff_delays()]:
            await asyncio.sleep(delay)
            try:
                ws, resumed = await resume_session(self.base_url, self.route, self._creds, self.seq.highest)
            except DuplexError as exc:
                if exc.code in FINAL_RESUME_CODES:
                    raise
                last_error = exc
                continue
            except (OSError, ConnectionClosed, TimeoutError) as exc:
                last_error = DuplexError(f"resume connect failed: {exc}")
                continue
            self._ws = ws
            self.resumes += 1
            self._process(resumed.raw)
            self._connected.set()
            return
        raise last_error or DuplexError("resume failed")

    async def _maintenance(self) -> None:
        next_heartbeat = self.clock() + self.heartbeat_s
        while not self.ended:
            await asyncio.sleep(MAINTENANCE_TICK_S)
            if not self._connected.is_set():
                continue
            now = self.clock()
            with contextlib.suppress(ConnectionClosed, DuplexError):
                seq = self.seq.ack_due(now)
                if seq is not None:
                    await self.send({"type": "session.event_ack", "server_event_seq": seq})
                    self.seq.mark_acked(seq, now)
                if now >= next_heartbeat:
                    self._heartbeat_sent_t, next_heartbeat = now, now + self.heartbeat_s
                    await self.send({"type": "session.heartbeat"})
