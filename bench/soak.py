"""Soak: N careless users for M minutes against a `duplex serve` this script starts, with a Triton kill halfway.

Each user loops over sessions on `/v1/realtime`. A session streams noise-and-silence audio at a random 1-3x real
time (`--max-speed`) in 200 ms appends, sends `response.cancel` at random while a response is active, and ends
one of five ways: `session.close`; a dropped socket and a `session.resume` on a new one, then a close; going
quiet until the idle TTL expires it; a dropped socket never resumed (the disconnect grace frees it); or a
`runtime_dead` close when Triton is killed. Refusals (`resource_exhausted`, `runtime_unavailable`) are retried.
Halfway through, tritonserver is SIGKILLed; `duplex serve` restarts it (serve/supervisor.py).

Sampled every `--sample-every` s: gateway, tritonserver and backend-stub RSS; admission slots in use (the
gateway's `duplex_sessions`) vs sessions the users hold; /dev/shm regions of the Python backend; /ready.
At the end the users stop, and the script checks what a leak would leave: slots still held, regions not
mapped by the live server (and, after it stops, any region it created), users' sessions that ended without a
typed error or close. JSON (`--out`) and a table on stdout.

    python bench/soak.py --sessions 4 --minutes 30 --out bench/results/soak-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import websockets

ROOT = Path(__file__).resolve().parents[1]
RATE = 16_000
APPEND_S = 0.2
SHM = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
IDLE_TTL_S = 20  # the soak profile's session idle TTL, so idle expiries happen within a run
ENDINGS = ("close", "resume", "idle", "abandon")
ENDING_WEIGHTS = (0.4, 0.3, 0.15, 0.15)
RECV_TIMEOUT_S = 60.0
REFUSAL_BACKOFF_S = 2.0
MESSAGE_CHARS = 160  # of an error message kept in the tally
DRAIN_WAIT_S = 90.0  # after the users stop: idle/grace expiries and cleanups settle
TRACEMALLOC_SITE = ROOT / "bench" / "tracemalloc_site"


# ---- the server and its processes ------------------------------------------------------------------------
def soak_profile(base: Path, out: Path) -> Path:
    """`base` with a short idle TTL (the sequences' idle timeout above it)."""
    lines = []
    for line in base.read_text().splitlines():
        key = line.partition(":")[0].strip()
        if key == "session_idle_ttl_s":
            line = f"session_idle_ttl_s: {IDLE_TTL_S}"
        elif key == "sequence_idle_timeout_s":
            line = f"sequence_idle_timeout_s: {IDLE_TTL_S * 3}"
        lines.append(line)
    out.write_text("\n".join(lines) + "\n")
    return out


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


def shm_regions() -> set[str]:
    return {p.name for p in SHM.glob(SHM_PREFIX + "*")}


def mapped_regions(pids: list[int]) -> set[str]:
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            found |= set(re.findall(r"/dev/shm/(" + SHM_PREFIX + r"[\w-]+)", (Path("/proc") / str(pid) / "maps")
                                    .read_text()))
    return found


@dataclass
class Server:
    port: int
    popen: subprocess.Popen[bytes]

    def pids(self) -> dict[str, list[int]]:
        kids = children(self.popen.pid)
        triton = [p for p in kids if "tritonserver" in cmdline(p).split(" ", 1)[0]]
        gateway = [p for p in kids if "gateway.serving" in cmdline(p)]
        stubs = [s for t in triton for s in children(t)]
        return {"gateway": gateway, "tritonserver": triton, "stubs": stubs}

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return 0, ""


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """`--server-env` pairs, and with `--tracemalloc-every` the bench-only sitecustomize on PYTHONPATH (it
    traces the gateway alone; bench/tracemalloc_site/sitecustomize.py)."""
    env = dict(pair.split("=", 1) for pair in args.server_env)
    if args.tracemalloc_every:
        out = args.cache_dir / "tracemalloc"
        if out.exists():
            shutil.rmtree(out)
        env |= {"BENCH_TRACEMALLOC_DIR": str(out), "BENCH_TRACEMALLOC_EVERY": str(args.tracemalloc_every),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(TRACEMALLOC_SITE), os.environ.get("PYTHONPATH")]))}
    return env


def start_server(args: argparse.Namespace, profile: Path, log: Path) -> Server:
    cmd = [sys.executable, "-m", "serve.cli", "serve", "--port", str(args.port), "--profile", str(profile),
           "--max-sessions", str(args.max_sessions or 2 * args.sessions), "--cache-dir", str(args.cache_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DUPLEX_READY_CACHE_S": "0", **server_env(args)}
    with open(log, "ab") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                 start_new_session=True)
    server = Server(args.port, popen)
    t0 = time.monotonic()
    while server.http("/ready")[0] != 200:
        if popen.poll() is not None or time.monotonic() - t0 > 600:
            raise SystemExit(f"duplex serve did not come up; see {log}")
        time.sleep(1)
    return server


def slots_in_use(metrics: str) -> int:
    return int(sum(float(v) for v in re.findall(r'^duplex_sessions\{state="\w+"\} ([\d.e+]+)$', metrics, re.M)))


# ---- the users --------------------------------------------------------------------------------------------
@dataclass
class Tally:
    alive: int = 0  # sessions the users hold now (created, not yet ended)
    opened: int = 0
    served: int = 0  # ended by the user's plan: closed, resumed-then-closed, expired
    ended_typed: Counter = field(default_factory=Counter)  # ended by a typed server error / close reason
    untyped: int = 0  # socket lost with no error event and no session.closed/expired: a defect
    errors: Counter = field(default_factory=Counter)  # every error event, by code
    error_messages: dict = field(default_factory=dict)  # code -> Counter of its messages (digits as N), to triage
    refusals: Counter = field(default_factory=Counter)
    endings: Counter = field(default_factory=Counter)
    cancels: int = 0
    resumes_ok: int = 0

    def error(self, err: dict[str, Any]) -> None:
        code = err["code"]
        self.errors[code] += 1
        message = re.sub(r"\d+", "N", str(err.get("message", "")))[:MESSAGE_CHARS]
        self.error_messages.setdefault(code, Counter())[message] += 1


class Conn:
    def __init__(self, ws: Any, tally: Tally) -> None:
        self.ws, self.tally = ws, tally
        self.session_id, self.token, self.last_seq = "", "", 0
        self.active_response = False
        self.ended: dict[str, Any] | None = None  # session.closed / session.expired / fatal error
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for text in self.ws:
                ev = json.loads(text)
                self.last_seq = max(self.last_seq, ev.get("server_event_seq", 0))
                kind = ev["type"]
                if kind in ("session.created", "session.resumed"):
                    self.session_id = ev.get("session", {}).get("id", self.session_id)
                    self.token = ev.get("resume_token", self.token)
                elif kind == "response.created":
                    self.active_response = True
                elif kind == "response.done":
                    self.active_response = False
                elif kind == "error":
                    self.tally.error(ev["error"])
                elif kind in ("session.closed", "session.expired"):
                    self.ended = ev

    async def send(self, ev: dict[str, Any]) -> bool:
        try:
            await self.ws.send(json.dumps(ev))
            return True
        except websockets.ConnectionClosed:
            return False

    async def drop(self) -> None:
        self.ws.transport.abort()  # no close frame: as a lost network would
        with contextlib.suppress(Exception):
            await self.reader


async def connect(url: str, tally: Tally, first: dict[str, Any] | None = None) -> tuple[Conn | None, dict]:
    ws = await websockets.connect(url, max_size=None, open_timeout=RECV_TIMEOUT_S)
    if first is not None:
        # a refusal that needs no frame (runtime_unavailable while Triton is down) may close the socket first:
        # its error event is still there to read
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(json.dumps(first))
    ev = json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))
    if ev["type"] == "error":
        tally.refusals[ev["error"]["code"]] += 1
        await ws.close()
        return None, ev
    conn = Conn(ws, tally)
    conn.session_id, conn.token = ev.get("session", {}).get("id", ""), ev.get("resume_token", "")
    return conn, ev


def audio_chunk(rng: np.random.Generator) -> str:
    n = int(RATE * APPEND_S)
    x = rng.normal(0, 0.05 if rng.random() < 0.5 else 0.001, n)  # noise or near-silence
    return base64.b64encode((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def stream(conn: Conn, seconds: float, speed: float, rng: np.random.Generator, cancel_p: float) -> bool:
    """Appends at `speed` x real time; random cancels. False when the session ended under us."""
    t_end = time.monotonic() + seconds / speed
    while time.monotonic() < t_end:
        if conn.ended is not None:
            return False
        if not await conn.send({"type": "input_audio_buffer.append", "audio": audio_chunk(rng),
                                "sample_rate_hz": RATE}):
            return False
        if conn.active_response and rng.random() < cancel_p * APPEND_S:
            conn.tally.cancels += 1
            await conn.send({"type": "response.cancel"})
        await asyncio.sleep(APPEND_S / speed)
    return conn.ended is None


async def finish(conn: Conn, how: str, wait_s: float) -> str:
    """Wait for the server's ending; 'served', a typed reason, or 'untyped'."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            await asyncio.shield(conn.reader)
    if conn.ended is None:
        return "untyped"
    reason = conn.ended.get("reason", "")
    expected = {"close": ("client_close", "session_close", "client_session_close"),
                "idle": ("idle_ttl_expired",)}.get(how, ())
    return "served" if reason in expected or not expected and reason else reason or "untyped"


async def one_session(base: str, tally: Tally, rng: np.random.Generator, args: argparse.Namespace,
                      stop_at: float) -> None:
    conn, ev = await connect(f"{base}/v1/realtime", tally)
    if conn is None:
        await asyncio.sleep(REFUSAL_BACKOFF_S)
        return
    tally.opened += 1
    tally.alive += 1
    how = str(rng.choice(ENDINGS, p=ENDING_WEIGHTS))
    tally.endings[how] += 1
    speed = float(rng.uniform(1.0, args.max_speed))
    try:
        seconds = float(min(rng.uniform(5, 40), max(1.0, stop_at - time.monotonic())))
        if not await stream(conn, seconds, speed, rng, args.cancel_rate):
            outcome = await finish(conn, how, 5.0)
        elif how == "resume":
            outcome = await _resume_then_close(base, conn, tally, rng, args, speed)
        elif how == "abandon":
            await conn.drop()
            outcome = "served"  # the server ends it at the disconnect grace; the slot check proves it did
        elif how == "idle":
            outcome = await finish(conn, how, IDLE_TTL_S + 30)
        else:
            await conn.send({"type": "session.close"})
            outcome = await finish(conn, how, 30.0)
    finally:
        tally.alive -= 1
        with contextlib.suppress(Exception):
            await conn.ws.close()
    if outcome == "served":
        tally.served += 1
    elif outcome == "untyped":
        tally.untyped += 1
    else:
        tally.ended_typed[outcome] += 1


async def _resume_then_close(base: str, conn: Conn, tally: Tally, rng: np.random.Generator,
                             args: argparse.Namespace, speed: float) -> str:
    await conn.drop()
    await asyncio.sleep(float(rng.uniform(0.5, 5.0)))
    resumed, ev = await connect(f"{base}/v1/realtime?resume=1", tally, {
        "type": "session.resume", "session_id": conn.session_id, "resume_token": conn.token,
        "last_received_server_event_seq": conn.last_seq})
    if resumed is None:
        return ev["error"]["code"]
    tally.resumes_ok += 1
    await stream(resumed, float(rng.uniform(3, 15)), speed, rng, args.cancel_rate)
    if resumed.ended is None:
        await resumed.send({"type": "session.close"})
    outcome = await finish(resumed, "close", 30.0)
    with contextlib.suppress(Exception):
        await resumed.ws.close()
    return outcome


async def user(i: int, base: str, tally: Tally, args: argparse.Namespace, stop_at: float) -> None:
    rng = np.random.default_rng(args.seed + i)
    await asyncio.sleep(float(rng.uniform(0, 3)))
    while time.monotonic() < stop_at:
        try:
            await one_session(base, tally, rng, args, stop_at)
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            tally.refusals[f"connect:{type(exc).__name__}"] += 1
            await asyncio.sleep(REFUSAL_BACKOFF_S)


# ---- sampling, the kill, the verdict ----------------------------------------------------------------------
def sample(server: Server, tally: Tally, t0: float, ours: set[str]) -> dict[str, Any]:
    """One row. `ours` collects every region our servers ever mapped (other processes on the host have their
    own); a region of ours that no live process of ours maps any more is a leak."""
    pids = server.pids()
    status, metrics = server.http("/metrics")
    mapped = mapped_regions(pids["tritonserver"] + pids["stubs"])
    ours |= mapped
    present = shm_regions() & ours
    return {"t_s": round(time.monotonic() - t0), "ready": server.http("/ready")[0],
            "gateway_rss_mb": rss_mb(pids["gateway"]), "triton_rss_mb": rss_mb(pids["tritonserver"]),
            "stubs_rss_mb": rss_mb(pids["stubs"]), "stubs": len(pids["stubs"]),
            "slots_in_use": slots_in_use(metrics) if status == 200 else None, "sessions_alive": tally.alive,
            "shm_regions": len(present), "shm_unmapped": len(present - mapped), "errors": sum(tally.errors.values()),
            "refusals": sum(tally.refusals.values()),  # when the opens were refused, beside the slots held
            "refused_full": tally.refusals["resource_exhausted"]}  # of those, at capacity (every slot held)


async def sampler(server: Server, tally: Tally, t0: float, ours: set[str], every_s: float,
                  samples: list[dict[str, Any]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        s = await asyncio.to_thread(sample, server, tally, t0, ours)
        samples.append(s)
        print(json.dumps(s), file=sys.stderr, flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def kill_triton(server: Server, at_s: float, record: dict[str, Any]) -> None:
    await asyncio.sleep(at_s)
    pids = server.pids()["tritonserver"]
    if pids:
        record.update(killed_pid=pids[0], killed_at_s=round(at_s))
        os.kill(pids[0], signal.SIGKILL)  # a crash of the server alone: its stubs are left for the supervisor
        t0 = time.monotonic()
        while (await asyncio.to_thread(server.http, "/ready"))[0] != 200:  # noqa: ASYNC110 - a remote state
            await asyncio.sleep(1)
        record["back_after_s"] = round(time.monotonic() - t0, 1)


def growth(samples: list[dict[str, Any]], key: str) -> float | None:
    """Mean of the last third minus mean of the first third (MB); None with too few samples."""
    if len(samples) < 3:
        return None
    third = len(samples) // 3
    return round(float(np.mean([s[key] for s in samples[-third:]]) - np.mean([s[key] for s in samples[:third]])), 1)


def verdict(samples: list[dict[str, Any]], final: dict[str, Any], tally: Tally, leftover: int,
            kill: dict[str, Any]) -> dict[str, Any]:
    warm = [s for s in samples if s["t_s"] >= 120] or samples
    back = kill.get("killed_at_s", 0) + kill.get("back_after_s", 0) + 120  # the new stubs have warmed up
    after = [s for s in samples if s["t_s"] >= back and s["ready"] == 200] if kill else warm
    return {"gateway_rss_growth_mb": growth(warm, "gateway_rss_mb"),
            "stubs_rss_growth_mb_after_restart": growth(after, "stubs_rss_mb"),
            "slots_leaked": final["slots_in_use"],
            "shm_unmapped_at_end": final["shm_unmapped"], "shm_left_after_stop": leftover,
            "untyped_endings": tally.untyped,
            "ok": bool(final["slots_in_use"] == 0 and final["shm_unmapped"] == 0 and leftover == 0
                       and tally.untyped == 0)}


def table(samples: list[dict[str, Any]], every: int) -> str:
    cols = ("t_s", "ready", "gateway_rss_mb", "triton_rss_mb", "stubs_rss_mb", "slots_in_use", "sessions_alive",
            "shm_regions", "shm_unmapped", "errors", "refusals", "refused_full")
    rows = [" | ".join(cols)] + [" | ".join(str(s[c]) for c in cols) for s in samples[::every]]
    return "\n".join(rows)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    profile = soak_profile(args.profile, args.cache_dir / "soak-profile.yaml")
    ours: set[str] = set()
    server = await asyncio.to_thread(start_server, args, profile, args.cache_dir / "soak-serve.log")
    base, tally, samples, kill = f"ws://127.0.0.1:{args.port}", Tally(), [], {}
    t0 = time.monotonic()
    stop_at = t0 + args.minutes * 60
    stop = asyncio.Event()
    try:
        watch = asyncio.create_task(sampler(server, tally, t0, ours, args.sample_every, samples, stop))
        killer = None if args.no_kill else asyncio.create_task(kill_triton(server, args.minutes * 30, kill))
        await asyncio.gather(*(user(i, base, tally, args, stop_at) for i in range(args.sessions)))
        t_drain = time.monotonic()
        while time.monotonic() - t_drain < DRAIN_WAIT_S:
            if (await asyncio.to_thread(sample, server, tally, t0, ours))["slots_in_use"] == 0:
                break
            await asyncio.sleep(2)
        final = await asyncio.to_thread(sample, server, tally, t0, ours)
        stop.set()
        await watch
        if killer is not None:
            killer.cancel()
    finally:
        server.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(server.popen.wait, 60)
    leftover = len(shm_regions() & ours)
    t = {f.name: getattr(tally, f.name) for f in fields(tally)}
    t["error_messages"] = {code: dict(c) for code, c in tally.error_messages.items()}
    return {"args": {k: str(v) for k, v in vars(args).items()}, "kill": kill, "final": final,
            "verdict": verdict(samples, final, tally, leftover, kill),
            "tally": {k: dict(v) if isinstance(v, Counter) else v for k, v in t.items()}, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4, help="concurrent users")
    ap.add_argument("--max-sessions", type=int, default=None,
                    help="the server's limit (default 2x users: dropped sockets hold their slot for the grace)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--max-speed", type=float, default=3.0, help="each session streams at 1..this x real time")
    ap.add_argument("--cancel-rate", type=float, default=0.2, help="response.cancel per second of active response")
    ap.add_argument("--sample-every", type=float, default=15.0)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--profile", type=Path, default=ROOT / "deploy" / "profiles" / "default.yaml")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "soak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-kill", action="store_true", help="no Triton kill halfway")
    ap.add_argument("--tracemalloc-every", type=float, default=0.0,
                    help="trace the gateway's allocations: sites every S s into CACHE_DIR/tracemalloc "
                         "(read them with bench/tracemalloc_report.py)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for duplex serve (e.g. MALLOC_ARENA_MAX=2, BENCH_GC_COLLECT_EVERY=60)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    every = max(1, round(60 / args.sample_every))
    print(table(result["samples"][::every] + [result["final"]], 1))
    print(json.dumps({k: result[k] for k in ("kill", "verdict")} | {"tally": result["tally"]}, indent=1))
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
