"""Real-WebSocket test harness: uvicorn on a free loopback port + a small async client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import uvicorn
import websockets

from gateway.app import create_app
from gateway.serving import uvicorn_config
from gateway.settings import GatewaySettings
from tests.gateway.fake_runtime import FakeRuntime

RECV_TIMEOUT_S = 5.0


@contextlib.asynccontextmanager
async def serve(runtime: FakeRuntime, **overrides: Any) -> AsyncIterator[str]:
    settings = GatewaySettings(**{"force_listen_count": 0, "tick_interval_s": 0.02, "reaper_interval_s": 0.05,
                                **overrides})
    app = create_app(settings, runtime=runtime)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes only this flag
        await asyncio.sleep(0.01)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


class Client:
    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []  # everything received, in order (the recorded stream)

    async def send(self, ev: dict[str, Any] | str) -> None:
        await self.ws.send(ev if isinstance(ev, str) else json.dumps(ev))

    async def recv(self, wait_s: float = RECV_TIMEOUT_S) -> dict[str, Any]:
        ev = json.loads(await asyncio.wait_for(self.ws.recv(), wait_s))
        self.events.append(ev)
        return ev

    async def until(self, type_: str, wait_s: float = RECV_TIMEOUT_S, **match: Any) -> list[dict[str, Any]]:
        """Receive until an event of `type_` (and matching fields) arrives; returns all received on the way."""
        got = []
        while True:
            ev = await self.recv(wait_s)
            got.append(ev)
            if ev["type"] == type_ and all(ev.get(k) == v for k, v in match.items()):
                return got

    async def quiet(self, seconds: float = 0.3) -> list[dict[str, Any]]:
        """Everything that arrives until the socket is quiet for `seconds`."""
        got = []
        with contextlib.suppress(TimeoutError):
            while True:
                got.append(await self.recv(seconds))
        return got


@contextlib.asynccontextmanager
async def connect(addr: str, path: str = "/v1/realtime", *, headers: dict[str, str] | None = None,
                  subprotocols: list[str] | None = None) -> AsyncIterator[Client]:
    async with websockets.connect(f"ws://{addr}{path}", additional_headers=headers,
                                  subprotocols=subprotocols, max_size=None) as ws:  # type: ignore[arg-type]
        yield Client(ws)


@functools.cache
def tone_clip(seconds: float = 1.0, *, hz: float = 220.0, amplitude: float = 0.3, rate: int = 16000,
              channels: int = 1, fmt: str = "WAV", mime: str = "wav") -> str:
    """A tone as a client's voice clip (`ref_audio`): a `data:audio/<mime>` URI of a `fmt` file."""
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    tone = (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, np.stack([tone] * channels, axis=1), rate, format=fmt)
    return f"data:audio/{mime};base64," + base64.b64encode(out.getvalue()).decode()


@functools.cache
def camera_frame(width: int, height: int, seed: int, fmt: str = "JPEG") -> str:
    """A noise image as a webcam would send it on an append (bare base64, protocol.md §9.4 V-1)."""
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format=fmt, **({"quality": 70} if fmt == "JPEG" else {}))
    return base64.b64encode(out.getvalue()).decode()


def pcm16_b64(ms: int, rate: int = 16000, amp: float = 0.2) -> str:
    n = rate * ms // 1000
    x = (np.sin(np.arange(n) * 0.07) * amp * 32767).astype("<i2")
    return base64.b64encode(x.tobytes()).decode()


def append(ms: int, rate: int = 16000, **extra: Any) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append", "audio": pcm16_b64(ms, rate), "sample_rate_hz": rate, **extra}
