"""Realtime load generator: N simulated users over `/v1/realtime` against a running `duplex serve` (issue 13).

Each user streams espeak-ng speech at exactly 1x real time in 200 ms appends (silence between sentences,
server VAD commits), plays the returned audio into a simulated 1x player and, with --cancel-every, barges in
with `response.cancel` while audio streams. Sweeps N in the given order and stops after the first N that no
longer holds real time (every session's audio keeps pace, no chunk gap > 1.2 s: targets.md P8; --keep-going runs
every N anyway). With
--triton-metrics it scrapes the stage metrics before and after each N and reports mean rows per engine step
per stage (batch occupancy) and P12 (`p12`: stage0's token rows per step that decoded tokens against the sessions
speaking, bench/loadgen/stages.py `occupancy`). It scrapes the gateway's own /metrics the same way and reports how long
generated text waited before its delta left (`transcript_behind_generation_ms`, P13). Progress goes to stderr; the JSON is rewritten after every N; a table is
printed last. Definitions of every figure: bench/loadgen/report.py.

    python bench/load_realtime.py --url ws://127.0.0.1:8000 --sessions 1,8,16,32,64 --duration 60 \\
        --profile deploy/profiles/h200-scripted.yaml --triton-metrics http://127.0.0.1:8002/metrics \\
        --cancel-every 10 --out bench/results/load-h200.json

Exit status: 0 when the sweep ran (held or not), 2 when the gateway (or the metrics endpoint) is unreachable
or not ready or opens no session at all, 1 on any other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import yaml  # noqa: E402

from bench.loadgen import gateway_load, stages, text_wait  # noqa: E402
from bench.loadgen.fixtures import FixtureError, speech_fixtures  # noqa: E402
from bench.loadgen.report import run_figures  # noqa: E402
from bench.loadgen.user import User, UserLog, long_instructions  # noqa: E402

READY_TIMEOUT_S = 5.0
PROGRESS_S = 5.0
START_SPREAD_S = 1.0  # users start spread over one model unit, as independent callers would
MAX_INSTRUCTIONS_CHARS = 32_768  # protocol.md: session.instructions
SETTLE_S = 2.0  # between two N: slots whose cleanup is still pending (§3.10 X6) come free


class Unreachable(RuntimeError):
    """The gateway or the metrics endpoint cannot be reached, or the gateway is not ready."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the gateway, ws://HOST:PORT")
    ap.add_argument("--sessions", default="1,8,16,32,64", help="comma-separated N, swept in order")
    ap.add_argument("--duration", type=float, required=True, help="seconds each N runs")
    ap.add_argument("--profile", type=Path, help="the deploy profile the server runs (labels scripted runs)")
    ap.add_argument("--triton-metrics", help="Triton's metrics URL, http://HOST:PORT/metrics")
    ap.add_argument("--gateway-metrics", help="the gateway's metrics URL (default: /metrics of --url); it must "
                                              "serve only this load while a step runs")
    ap.add_argument("--keep-going", action="store_true",
                    help="run every N of the sweep, also after one that did not hold real time")
    ap.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    ap.add_argument("--cancel-every", type=float, help="seconds between barge-in cancels per session")
    ap.add_argument("--unit-align-s", type=float, default=None,
                    help="the gateway's DUPLEX_UNIT_ALIGN_S (its unit grid after a commit; 0: off; default: the "
                         "--profile's unit_align_s, which `duplex serve` gives the gateway, else 0)")
    ap.add_argument("--unit-align-min-sessions", type=int, default=None,
                    help="the gateway's DUPLEX_UNIT_ALIGN_MIN_SESSIONS (it aligns only while that many sessions "
                         "are live; default: the --profile's unit_align_min_sessions, else 0)")
    ap.add_argument("--instructions-chars", type=int, default=0,
                    help="each session's system prompt, this many characters of filler (at most 32768; the "
                         "byte-level test tokenizers make about one KV position each): sessions that start deep "
                         "in their context, as long calls do; keep it below 0.75 x the profile's kv_window")
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--commit", help="the commit the server runs (default: this checkout's git HEAD; a copy "
                                     "without its own history, such as a device snapshot, passes it)")
    args = ap.parse_args(argv)
    try:
        args.sessions = [int(n) for n in args.sessions.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--sessions must be comma-separated integers, got {args.sessions!r}")
    if not args.sessions or min(args.sessions) < 1 or args.duration <= 0:
        ap.error("--sessions needs N >= 1 and --duration must be > 0")
    if not 0 <= args.instructions_chars <= MAX_INSTRUCTIONS_CHARS:
        ap.error(f"--instructions-chars must be 0..{MAX_INSTRUCTIONS_CHARS} (protocol.md: session.instructions)")
    args.gateway_metrics = args.gateway_metrics or f"{http_base(args.url)}/metrics"
    try:
        args.profile_values = read_profile(args.profile)  # read once: the sweep takes the plan and device from it
        if args.unit_align_s is None:  # the grid follows the gateway's, which the profile sets
            args.unit_align_s = profile_unit_align_s(args.profile_values)
        if args.unit_align_min_sessions is None:
            args.unit_align_min_sessions = int(args.profile_values.get("unit_align_min_sessions") or 0)
    except (OSError, yaml.YAMLError, TypeError, ValueError) as exc:
        ap.error(f"cannot read unit_align_s from --profile {args.profile}: {exc}")
    return args


# -- context ------------------------------------------------------------------------------------------
def http_base(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def check_ready(url: str) -> None:
    ready = f"{http_base(url)}/ready"
    try:
        with urllib.request.urlopen(ready, timeout=READY_TIMEOUT_S) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot reach the gateway at {url} ({ready}): {exc}") from exc
    if status != 200:
        raise Unreachable(f"the gateway at {url} is not ready: GET {ready} answered {status}")


def read_profile(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    return data if isinstance(data, dict) else {}


def profile_unit_align_s(profile: dict[str, Any]) -> float:
    """The profile's `unit_align_s` (`duplex serve` passes it to the gateway as DUPLEX_UNIT_ALIGN_S); 0 when absent."""
    return float(profile.get("unit_align_s") or 0.0)


def scripted_plan(profile: dict[str, Any]) -> dict[str, Any] | None:
    stage0 = ((profile.get("engine_options") or {}).get("stage0") or {})
    return stage0.get("scripted_decisions")


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=_ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def device_name(profile: dict[str, Any]) -> str:
    device = str(profile.get("device", "unknown"))
    if device.startswith("cuda") and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False).stdout.strip().splitlines()
        if out:
            return f"{device}: {out[0]}"
    return device


def scrape(url: str | None) -> stages.Sample | None:
    if url is None:
        return None
    try:
        return stages.scrape(url)
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot scrape Triton's metrics at {url}: {exc}") from exc


def scrape_gateway(url: str) -> str:
    """The gateway's /metrics text (text_wait and gateway_load read it)."""
    try:
        with urllib.request.urlopen(url, timeout=text_wait.SCRAPE_TIMEOUT_S) as resp:
            return resp.read().decode()
    except (OSError, ValueError) as exc:
        raise Unreachable(f"cannot scrape the gateway's metrics at {url}: {exc}") from exc


# -- one sweep step -----------------------------------------------------------------------------------
async def _progress(n: int, users: list[User], t0: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_S)
        logs = [u.log for u in users]
        resp = sum(len(log.responses) for log in logs)
        audio = sum(sum(r.audio_ms) for log in logs for r in log.responses.values()) / 1000.0
        errors = sum(sum(log.errors.values()) for log in logs)
        up = sum(1 for log in logs if log.opened_t is not None and log.failure is None)
        print(f"[N={n}] t={time.monotonic() - t0:5.1f}s sessions up {up}/{n} responses {resp} "
              f"audio {audio:.1f}s errors {errors}", file=sys.stderr, flush=True)


async def _start(user: User, delay_s: float) -> UserLog:
    await asyncio.sleep(delay_s)
    try:
        return await user.run()
    except Exception as exc:  # noqa: BLE001 - one broken session is a finding of the run, not its end
        traceback.print_exc()
        user.log.failure = f"load generator fault: {type(exc).__name__}: {exc}"
        user.log.errors["loadgen_fault"] += 1
        return user.log


async def run_step(n: int, args: argparse.Namespace, speech: list[Any],
                   plan: dict[str, int] | None = None) -> list[UserLog]:
    def live() -> int:  # the step's open sessions: the gateway's live count while it serves only this load
        return sum(u.live for u in users)

    users = [User(i, args.url, speech, args.duration, cancel_every_s=args.cancel_every, api_key=args.api_key,
                  plan=plan, unit_align_s=args.unit_align_s, unit_align_min_sessions=args.unit_align_min_sessions,
                  live_sessions=live,
                  instructions=long_instructions(args.instructions_chars) if args.instructions_chars else None)
             for i in range(n)]
    progress = asyncio.create_task(_progress(n, users, time.monotonic()))
    try:
        return list(await asyncio.gather(*(_start(u, i * START_SPREAD_S / n) for i, u in enumerate(users))))
    finally:
        progress.cancel()


def step_record(n: int, logs: list[UserLog], scripted: bool | None, before: stages.Sample | None,
                after: stages.Sample | None, gw_before: str | None = None, gw_after: str | None = None,
                seconds: float = 0.0) -> dict[str, Any]:
    """`seconds`: between the two scrapes of the stage metrics; `gw_*`: the gateway's /metrics text."""
    run = run_figures(n, logs, scripted)
    texts = (gw_before, gw_after)
    run["transcript_behind_generation_ms"] = text_wait.figures(*(None if t is None else text_wait.parse(t)
                                                                 for t in texts))
    run["gateway"] = gateway_load.figures(*(None if t is None else gateway_load.parse(t) for t in texts), seconds)
    empty = {s: None for s in stages.STAGES}
    m = stages.means(before, after) if before is not None and after is not None else None
    run["stage_rows_per_step"] = m["rows_per_step"] if m else empty
    run["stage_step_ms"] = m["step_ms"] if m else empty
    run["stage_queue_wait_ms"] = m["queue_wait_ms"] if m else empty
    run["stage_busy_ms_per_s"] = stages.busy(before, after, seconds) if m else empty
    run["stage_step_ms_by_kind"] = stages.by_kind(before, after) if m else {}
    run["p12"] = stages.occupancy(run["stage_step_ms_by_kind"], run["audio_s"], seconds)
    t = stages.tails(before, after) if before is not None and after is not None else None
    for key in ("step_p99_ms", "slow_steps", "graph_misses"):
        run[f"stage_{key}"] = t[key] if t else empty
    return run


# -- output -------------------------------------------------------------------------------------------
def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.0f}" if isinstance(x, float) else str(x)


def _p12(p: dict[str, Any]) -> str:
    rows, speaking = p.get("token_rows_per_step"), p.get("speaking_sessions")
    return "-" if rows is None or speaking is None else f"{rows:.2f}/{speaking:.2f}"


def table(runs: list[dict[str, Any]]) -> str:
    head = ("N", "held", "c->audio p50/p99", "cancel p50/p99", "text-audio p50", "text behind gen p50/p99",
            "max gap (p99, >1.2 s)", "underruns", "errors", "rows/step s0/tts/t2w", "P12 token rows/speaking",
            "in phase",
            "unit->audio p50 by position 1/2/3/4+")
    lines = [" | ".join(head)]
    for r in runs:
        rows = r["stage_rows_per_step"]
        lines.append(" | ".join((
            str(r["sessions"]), "yes" if r["held_realtime"] else "NO",
            f"{_fmt(r['commit_to_first_audio_ms']['p50'])}/{_fmt(r['commit_to_first_audio_ms']['p99'])}",
            f"{_fmt(r['cancel_to_last_audio_ms']['p50'])}/{_fmt(r['cancel_to_last_audio_ms']['p99'])}",
            _fmt(r["transcript_delay_ms"]["p50"]),
            f"{_fmt(r['transcript_behind_generation_ms']['p50'])}/{_fmt(r['transcript_behind_generation_ms']['p99'])}",
            f"{_fmt(r['max_chunk_gap_ms'])} ({_fmt(r['chunk_gap_ms']['p99'])}, {r['chunk_gap_ms']['over_bound']})",
            str(r["underruns"]),
            str(sum(r["errors"].values())),
            "/".join("-" if rows[s] is None else f"{rows[s]:.2f}" for s in stages.STAGES),
            _p12(r.get("p12") or {}),
            "-" if r.get("first_audio_in_phase") is None else f"{r['first_audio_in_phase']:.2f}",
            "/".join(_fmt(p["p50"]) for p in r.get("unit_to_audio_by_position_ms", {}).values()) or "-")))
    return "\n".join(lines)


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


async def sweep(args: argparse.Namespace) -> dict[str, Any]:
    check_ready(args.url)
    profile = args.profile_values
    plan = scripted_plan(profile)
    scripted = None if args.profile is None else plan is not None  # without a profile nobody says
    speech = speech_fixtures()
    doc: dict[str, Any] = {"commit": args.commit or git_commit(), "device": device_name(profile),
                           "profile": str(args.profile) if args.profile else None, "scripted": scripted,
                           "scripted_plan": plan, "instructions_chars": args.instructions_chars,
                           "url": args.url, "duration_s": args.duration, "cancel_every_s": args.cancel_every,
                           "unit_align_s": args.unit_align_s,  # effective: --unit-align-s, else the profile's
                           "unit_align_min_sessions": args.unit_align_min_sessions,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for i, n in enumerate(args.sessions):
        if i:
            await asyncio.sleep(SETTLE_S)
        print(f"[N={n}] {n} sessions for {args.duration:.0f}s", file=sys.stderr, flush=True)
        before, gw_before, t0 = scrape(args.triton_metrics), scrape_gateway(args.gateway_metrics), time.monotonic()
        logs = await run_step(n, args, speech, plan)
        if not any(log.opened_t is not None for log in logs):
            raise Unreachable(f"no session of {n} could open at {args.url}: {logs[0].failure}")
        after, t1 = scrape(args.triton_metrics), time.monotonic()
        run = step_record(n, logs, scripted, before, after, gw_before, scrape_gateway(args.gateway_metrics), t1 - t0)
        doc["runs"].append(run)
        write(args.out, doc)
        print(f"[N={n}] held real time: {run['held_realtime']}"
              + ("" if run["held_realtime"] else f" ({'; '.join(run['not_held'])})"), file=sys.stderr, flush=True)
        if not run["held_realtime"] and not args.keep_going:
            break
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        doc = asyncio.run(sweep(args))
    except Unreachable as exc:
        print(f"load_realtime: {exc}", file=sys.stderr)
        return 2
    except FixtureError as exc:
        print(f"load_realtime: {exc}", file=sys.stderr)
        return 1
    label = {True: "scripted", False: "sampled", None: "unknown (no --profile)"}[doc["scripted"]]
    print(f"results: {args.out} (commit {doc['commit']}, {doc['device']}, decisions: {label})")
    print(table(doc["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
