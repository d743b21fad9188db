"""`duplex talk`: stream a WAV file to the gateway in real time, save the replies, print transcript + timings.

    duplex talk --wav question.wav [--url http://127.0.0.1:8000] [--out-dir replies]

The file is sent as a continuous client sends a microphone (200 ms appends at 16 kHz), followed by an
explicit commit (unless --no-commit) and then real-time silence, so the model keeps its units while it
answers. Entry point for serve/cli.py: `talk_main(argv) -> int`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import unicodedata
from pathlib import Path
from typing import Any, TextIO

from clients.audio import CHUNK_MS, INPUT_RATE, read_wav, silence, write_wav
from clients.client import DuplexClient
from clients.connection import DEFAULT_SESSION, DuplexError
from clients.events import ResponseCreated, ResponseDone, TextDelta
from clients.report import format_summary

DEFAULT_URL = "http://127.0.0.1:8000"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duplex talk", description=__doc__.split("\n\n")[0])
    p.add_argument("--wav", required=True, type=Path, help="speech to send (any rate; resampled to 16 kHz)")
    p.add_argument("--url", default=DEFAULT_URL, help="gateway base URL (http(s):// or ws(s)://)")
    p.add_argument("--route", default="/v1/realtime")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where reply_N.wav files go")
    p.add_argument("--no-commit", action="store_true", help="continuous style: no commit after the file")
    p.add_argument("--tail-s", type=float, default=2.0, help="quiet time after the last reply before closing")
    p.add_argument("--max-wait-s", type=float, default=30.0, help="give up this long after the file ends")
    p.add_argument("--speed", type=float, default=1.0, help="pacing factor (1 = real time)")
    p.add_argument("--instructions", default=None, help="system prompt for the session")
    p.add_argument("--summary-json", type=Path, default=None, help="also write the timing summary here")
    return p


ESCAPED_CATEGORIES = ("Cc", "Cf")  # controls (ESC, BEL, CR, newline…) and format characters (bidi overrides)


def printable(text: str) -> str:
    """`text` with control and format characters escaped (`\\x1b`, `\\n`): a model with random weights says
    any bytes, and a raw escape sequence would drive the user's terminal."""
    return "".join(ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) in ESCAPED_CATEGORIES
                   else ch for ch in text)


async def _print_live(client: DuplexClient, out: TextIO) -> None:
    """Transcript as it streams: one line per response, deltas appended in place."""
    i = 0
    while True:
        ev = await client.wait_for(None, since=i)
        i += 1  # wait_for(None, since=i) returns history[i]
        if isinstance(ev, ResponseCreated):
            out.write(f"\nassistant [{ev.response_id}]: ")
        elif isinstance(ev, TextDelta):
            out.write(printable(ev.delta))
        elif isinstance(ev, ResponseDone):
            out.write(f"  <{printable(str(ev.status))}: {printable(str(ev.reason))}>\n")
        out.flush()


async def _wait_replies(client: DuplexClient, tail_s: float, max_wait_s: float, speed: float) -> None:
    """Keep streaming real-time silence until the replies are over (quiet for tail_s) or max_wait_s."""
    loop_t0 = client.clock()
    quiet_since: float | None = None
    chunk = silence(CHUNK_MS).tobytes()
    while client.clock() - loop_t0 < max_wait_s and not client.ended:
        await client.append(chunk, sample_rate_hz=INPUT_RATE)
        await asyncio.sleep(CHUNK_MS / 1000.0 / speed)
        active = [r for r in client.responses.values() if r.done is None]
        if client.responses and not active:
            quiet_since = quiet_since or client.clock()
            if client.clock() - quiet_since >= tail_s:
                return
        else:
            quiet_since = None


async def run_talk(args: argparse.Namespace, out: TextIO | None = None) -> dict[str, Any]:
    out = out or sys.stdout
    pcm, _ = read_wav(args.wav, INPUT_RATE)
    session = {**DEFAULT_SESSION, "instructions": args.instructions} if args.instructions else None
    client = DuplexClient(args.url, route=args.route, session=session)
    created = await client.connect()
    out.write(f"session {created.session_id} ({len(pcm) / INPUT_RATE:.2f} s of audio from {args.wav})\n")
    printer = asyncio.create_task(_print_live(client, out))
    try:
        await client.stream(pcm, INPUT_RATE, speed=args.speed, last_label="speech_end")
        if not args.no_commit:
            await client.commit()
        await _wait_replies(client, args.tail_s, args.max_wait_s, args.speed)
    finally:
        await client.close(reason="talk_done")
        printer.cancel()
    files = []
    for n, resp in enumerate(client.responses.values(), start=1):
        if resp.audio_ms > 0:
            files.append(str(write_wav(args.out_dir / f"reply_{n}.wav", resp.pcm16(), resp.sample_rate_hz)))
    summary = {"session_id": created.session_id, "files": files, **client.collector.summary()}
    out.write("\n" + format_summary(summary) + "\n")
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_text(json.dumps(summary, indent=2))
    return summary


def talk_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.wav.is_file():
        print(f"duplex talk: no such file: {args.wav}", file=sys.stderr)
        return 1
    try:
        summary = asyncio.run(run_talk(args))
    except DuplexError as exc:
        print(f"duplex talk: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"duplex talk: {exc}", file=sys.stderr)
        return 1
    return 0 if summary["responses"] else 3


if __name__ == "__main__":
    raise SystemExit(talk_main(sys.argv[1:]))

