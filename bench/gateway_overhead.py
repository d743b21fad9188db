"""P10: the gateway's CPU per WebSocket event against a bare echo WebSocket server (targets.md P10).

Two servers on this machine, each driven for `--duration` seconds by the same client with N sessions:
- `duplex serve` with the torch-free loopback engines (tests/triton/loopback.py: a loud unit speaks four text
  tokens and a tone), so the runtime costs little and the gateway does its whole job: Realtime parsing and
  validation, PCM decode, server VAD (`--vad off`: turn_detection null), unit cutting, the Triton stream, the
  response events, the journal;
- a bare echo server: the same uvicorn and WebSocket stack, an ASGI app that sends every text frame back.
Each session sends `input_audio_buffer.append` with `--chunk-ms` of 16 kHz PCM16 at real-time pace (a loud
tone: the loopback model speaks every unit, so response events flow back) and reads all it gets. The server's
CPU time (the gateway process alone: /proc/PID/stat utime + stime) is read before and after the streaming;
per event = CPU seconds / (frames received + frames sent by the server). Ratio = gateway / echo.

    python bench/gateway_overhead.py --sessions 64 --duration 30 --json p10.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import gateway_load  # noqa: E402
from bench.soak import Server, children, cmdline, start_server  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402

LOOPBACK = ROOT / "tests" / "e2e" / "profiles" / "loopback.yaml"
RATE = 16_000
TICKS = os.sysconf("SC_CLK_TCK")
ECHO_OFFSET = 7  # the echo server's port is --port + 7 (duplex serve takes --port + 1..3 for Triton)


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The baseline: accept, then send every text frame back unchanged."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] == "http":  # readiness probe
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    while True:
        msg = await receive()
        if msg["type"] == "websocket.disconnect":
            return
        await send({"type": "websocket.send", "text": msg.get("text")})


def cpu_s(pid: int) -> float:
    fields = (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def chunk(chunk_ms: int) -> str:
    n = RATE * chunk_ms // 1000
    tone = (8000 * np.sin(2 * np.pi * 440 * np.arange(n) / RATE)).astype("<i2")  # loud: the loopback speaks
    return base64.b64encode(tone.tobytes()).decode()


class Count:
    def __init__(self) -> None:
        self.sent = self.received = self.errors = 0


async def session(url: str, opener: list[dict[str, Any]], audio: str, chunk_ms: int, seconds: float,
                  count: Count) -> None:
    async with websockets.connect(url, max_size=2**24) as ws:
        for ev in opener:
            await ws.send(json.dumps(ev))
            count.sent += 1

        async def read() -> None:
            async for frame in ws:
                count.received += 1
                if '"type":"error"' in frame.replace(" ", "") and "response_not_active" not in frame:
                    count.errors += 1

        reader = asyncio.create_task(read())
        frame = json.dumps({"type": "input_audio_buffer.append", "audio": audio})
        t0, k = time.monotonic(), 0
        while (due := t0 + k * chunk_ms / 1000) - t0 < seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await ws.send(frame)
            count.sent += 1
            k += 1
        await asyncio.sleep(0.5)  # what is in flight comes back
        reader.cancel()


def scrape(metrics_url: str) -> gateway_load.Sample:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        return gateway_load.parse(resp.read().decode())


async def drive(url: str, opener: list[dict[str, Any]], pid: int, args: argparse.Namespace,
                metrics_url: str | None = None) -> dict[str, Any]:
    """`metrics_url`: the gateway's /metrics, for its event loop's lag over the run (the echo server has none)."""
    count, audio = Count(), chunk(args.chunk_ms)
    before = scrape(metrics_url) if metrics_url else None
    start_cpu, t0 = cpu_s(pid), time.monotonic()
    await asyncio.gather(*(session(url, opener, audio, args.chunk_ms, args.duration, count)
                           for _ in range(args.sessions)))
    cpu, wall = cpu_s(pid) - start_cpu, time.monotonic() - t0
    events = count.sent + count.received
    out = {"cpu_s": round(cpu, 2), "wall_s": round(wall, 1), "frames_in": count.sent, "frames_out": count.received,
           "errors": count.errors, "cpu_us_per_event": round(1e6 * cpu / max(events, 1), 1),
           "cpu_share_of_one_core": round(cpu / wall, 2)}
    if metrics_url:
        out["loop_lag_ms"] = gateway_load.figures(before, scrape(metrics_url), wall)["loop_lag_ms"]
    return out


def echo_server(port: int, log: Path, deflate: bool) -> subprocess.Popen[bytes]:
    """`deflate`: permessage-deflate as the gateway has it (DUPLEX_WS_PER_MESSAGE_DEFLATE), so both pay alike."""
    cmd = [sys.executable, "-m", "uvicorn", "bench.gateway_overhead:echo_app", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", "--ws-max-size", str(2**24), "--ws-per-message-deflate", str(deflate)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the echo server did not come up; see {log}")


def profile(sessions: int, out: Path) -> Path:
    text = LOOPBACK.read_text().replace("max_sessions: 8", f"max_sessions: {sessions}")
    out.write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of streaming per server")
    ap.add_argument("--chunk-ms", type=int, default=100, help="audio per append")
    ap.add_argument("--vad", choices=("on", "off"), default="on", help="server VAD (the default) or none")
    ap.add_argument("--port", type=int, default=18_300, help="the gateway's; the echo server's is this + 7")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="p10-"))
    deflate = GatewaySettings.from_env().ws_per_message_deflate  # the gateway reads the same environment
    turn = {"type": "server_vad"} if args.vad == "on" else None
    opener = [{"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"], "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": turn}}}}]
    result: dict[str, Any] = {"what": "P10 gateway CPU per event vs a bare echo WebSocket server",
                              "sessions": args.sessions, "duration_s": args.duration, "chunk_ms": args.chunk_ms,
                              "vad": args.vad, "cores": os.cpu_count(), "ws_per_message_deflate": deflate}
    echo_port = args.port + ECHO_OFFSET
    echo = echo_server(echo_port, tmp / "echo.log", deflate)
    try:
        result["echo"] = asyncio.run(drive(f"ws://127.0.0.1:{echo_port}/", [], echo.pid, args))
    finally:
        echo.terminate()
        echo.wait(10)
    print("echo", json.dumps(result["echo"]), flush=True)
    server_args = argparse.Namespace(port=args.port, max_sessions=args.sessions, sessions=args.sessions,
                                     cache_dir=tmp / "cache", server_env=[], tracemalloc_every=0)
    server: Server = start_server(server_args, profile(args.sessions, tmp / "loopback.yaml"), tmp / "serve.log")
    try:
        gateway = next(p for p in children(server.popen.pid) if "gateway.serving" in cmdline(p))
        url = f"ws://127.0.0.1:{args.port}/v1/realtime?autostart=0"
        result["gateway"] = asyncio.run(drive(url, opener, gateway, args, f"http://127.0.0.1:{args.port}/metrics"))
    finally:
        server.popen.send_signal(2)
        server.popen.wait(60)
    print("gateway", json.dumps(result["gateway"]), flush=True)
    echo_us = result["echo"]["cpu_us_per_event"]
    result["ratio"] = round(result["gateway"]["cpu_us_per_event"] / echo_us, 2) if echo_us else None
    print(f"\nP10 ({args.sessions} sessions, {args.chunk_ms} ms appends, VAD {args.vad}, {os.cpu_count()} cores): "
          f"gateway {result['gateway']['cpu_us_per_event']} us/event, echo {result['echo']['cpu_us_per_event']} "
          f"us/event, ratio {result['ratio']} (target <= 1.5)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
