"""Barge-in walkthrough: greet, ask, interrupt the answer while it plays, get the second answer, close.

    python -m clients.examples.barge_in --url http://127.0.0.1:8000 --out-dir barge_in_out

A continuous simulated microphone streams the three utterances (WAV files, or espeak-ng from text) with
real-time silence between them. The interruption's first append carries `force_barge_in` (the client's
overlap verdict, §8.3 O1); on `output_audio_buffer.cleared` playback stops and is acknowledged with
`truncate:true` (§8.4 B5). Every reply is played (simulated in real time) and acknowledged. Writes one WAV per
reply, `summary.json` (transcripts + §10.2 timings) and `events.jsonl` (every frame sent and received).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from clients.audio import write_wav
from clients.client import DuplexClient
from clients.examples.mic import SimulatedMic, speech
from clients.response import ResponseHandle

STEP_TIMEOUT_S = 8.0
POLL_S = 0.05


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="barge_in", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--out-dir", type=Path, default=Path("barge_in_out"))
    p.add_argument("--greet", default="Hello there!")
    p.add_argument("--ask", default="Please tell me a long story about the sea.")
    p.add_argument("--interrupt", default="Wait, stop. What is the capital of France?")
    for name in ("greet", "ask", "interrupt"):
        p.add_argument(f"--{name}-wav", type=Path, default=None, help=f"use this file instead of --{name}")
    p.add_argument("--interrupt-after-ms", type=int, default=1000, help="played audio before interrupting")
    p.add_argument("--speed", type=float, default=1.0, help="microphone pacing (1 = real time)")
    return p


async def _play_and_ack(resp: ResponseHandle) -> int:
    played = await asyncio.wait_for(resp.wait_drained(), STEP_TIMEOUT_S)
    await resp.ack(played)
    return played


async def _interrupt(client: DuplexClient, mic: SimulatedMic, resp: ResponseHandle, pcm: Any,
                     after_ms: int) -> int:
    """Wait until `after_ms` of `resp` has played, then talk over it with a barge-in verdict."""
    while resp.played_ms() < after_ms:
        if resp.done is not None and resp.drained_at() is not None and client.clock() > resp.drained_at():
            raise RuntimeError("the answer finished playing before it could be interrupted")
        await asyncio.sleep(POLL_S)
    mark = client.mark()
    if resp.done is not None:
        # Generated already but still playing: stop our own output explicitly (an idle clear changes no
        # epoch, §3.6), then talk; the gateway may also answer the verdict itself (§8.4 B3).
        await client.send({"type": "output_audio_buffer.clear"})
    say = asyncio.create_task(mic.say(pcm, force_barge_in=True))
    await client.wait_for("output_audio_buffer.cleared", since=mark, timeout=STEP_TIMEOUT_S,
                          where=lambda ev: ev.raw.get("response_id") == resp.response_id)
    played = resp.played_ms()
    await resp.ack(played, truncate=True)  # B5: report the heard position and truncate history to it
    await say
    return played


async def run(args: argparse.Namespace) -> dict[str, Any]:
    utterances = {name: speech(getattr(args, name), getattr(args, f"{name}_wav"))
                  for name in ("greet", "ask", "interrupt")}
    steps: list[dict[str, Any]] = []
    async with DuplexClient(args.url) as client, SimulatedMic(client, args.speed) as mic:
        mark = client.mark()
        await mic.say(utterances["greet"])
        greeting = await client.next_response(since=mark, timeout=STEP_TIMEOUT_S)
        steps.append({"step": "greet", "response_id": greeting.response_id,
                      "played_ms": await _play_and_ack(greeting)})

        mark = client.mark()
        await mic.say(utterances["ask"])
        answer = await client.next_response(since=mark, timeout=STEP_TIMEOUT_S)
        mark = client.mark()
        heard = await _interrupt(client, mic, answer, utterances["interrupt"], args.interrupt_after_ms)
        done = await answer.wait_done(STEP_TIMEOUT_S)
        steps.append({"step": "ask", "response_id": answer.response_id, "played_ms": heard,
                      "status": done.status, "reason": done.reason})

        second = await client.next_response(since=mark, timeout=STEP_TIMEOUT_S)
        steps.append({"step": "second_answer", "response_id": second.response_id,
                      "played_ms": await _play_and_ack(second)})
        await asyncio.sleep(0.2)  # let the last playback.acknowledged arrive before closing
    return _write_outputs(args.out_dir, client, steps)


def _write_outputs(out_dir: Path, client: DuplexClient, steps: list[dict[str, Any]]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = {"greet": "greeting_reply.wav", "ask": "answer_interrupted.wav", "second_answer": "second_answer.wav"}
    for step in steps:
        resp = client.responses[step["response_id"]]
        step["transcript"] = resp.transcript
        step["wav"] = str(write_wav(out_dir / names[step["step"]], resp.pcm16(), resp.sample_rate_hz))
    summary = {"session_id": client.session_id, "steps": steps, "timings": client.collector.summary(),
               "errors": [e.raw for e in client.errors()]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with (out_dir / "events.jsonl").open("w") as f:
        for entry in client.log:
            f.write(json.dumps(entry) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary = asyncio.run(run(args))
    for step in summary["steps"]:
        print(f"{step['step']:<14} {step['response_id']}  played {step['played_ms']} ms  {step['transcript']!r}")
    print(f"wrote {args.out_dir}/summary.json and events.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
