"""A seeded random client for a gateway (tests/gateway/test_random_client.py with the fake runtime,
tests/e2e/test_random_client.py on the real stack; `python -m tests.gateway.random_client --addr HOST:PORT` sweeps
seeds against a running one).

Each run sends a few hundred frames in a random order: well-formed events (appends at every accepted rate, some
with camera frames, flushes, commits, clears, cancels, response.create, item retrieve / delete / truncate and
playback acks naming items the session really has, updates with a voice clip among them, heartbeats, event acks)
mixed with bad frames whose code does not depend on the session's state (test_errors_frames.py's cases). Whatever
the order, protocol.md promises: a bad frame gets its own typed error with its `event_id` echoed (§1.6, §1.7); a
well-formed event is refused only with a code its state allows; no internal fault, and the session is never closed
under the client; the recorded stream stays conformant (Appendix B); and the session still answers afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import websockets

from gateway.protocol.errors import CODES
from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.harness import Client, append, camera_frame, connect, pcm16_b64, tone_clip
from tests.gateway.scenario import assert_conformant
from tests.gateway.test_errors_frames import CASES
from tests.gateway_ops.wire import eventually

FRAMES = 250
# Bad frames refused with the same code in every state (the others depend on it: a response.create option
# against an active response, a cancel with nothing active, an event ack past the last seq).
STATE_FREE = {"invalid_json", "non_object", "missing_type", "long_event_id", "ill_typed_field", "unknown_event",
              "odd_pcm16", "bad_base64", "rate_out_of_range", "stereo_wav", "wav_rate_conflict", "empty_audio",
              "format", "three_frames", "data_prefix", "not_an_image", "server_owned", "server_owned_extra",
              "model_update", "semantic_vad", "text_append", "push_text_alias", "user_text_item", "item_type",
              "missing_item_id", "item_not_found", "ack_unknown", "ack_missing_played", "truncate_unknown",
              "event_ack_type", "turn_signal", "session_create_late", "resume_late"}
BAD = [(name, frame, code) for name, frame, code, _ in CASES if name in STATE_FREE]
RATES = (8000, 16000, 24000, 44100, 48000)
# a runtime operation's injected failure -> the code the client gets (§1.7): an append's fails the active response
# or is reported, a cancel's is reported (the response still ends), an update's refuses that update
FAULTS = {"append": ("internal_error", "runtime_append_failed"), "cancel": ("internal_error", "runtime_signal_failed"),
          "update": ("internal_error", "runtime_update_failed")}


@dataclass
class Seen:
    """What the reader learned from the server: ids the next frames can name."""

    response_ids: list[str] = field(default_factory=list)
    item_ids: list[str] = field(default_factory=list)
    last_seq: int = 0


def _learn(seen: Seen, ev: dict[str, Any]) -> None:
    seen.last_seq = max(seen.last_seq, ev.get("server_event_seq", 0))
    if ev["type"] == "response.created":
        seen.response_ids.append(ev["response"]["id"] if "response" in ev else ev["response_id"])
    elif ev["type"] in ("conversation.item.added", "conversation.item.created") and "item" in ev:
        seen.item_ids.append(ev["item"]["id"])


def error_of(ev: dict[str, Any]) -> tuple[str, str | None]:
    """(code, the echoed client event_id) in either error shape (§1.6)."""
    e = ev["error"]
    if isinstance(e, dict):  # nested: /v1/realtime
        return e["code"], e["event_id"]
    return ev["code"], ev["client_event_id"]  # flat: /v1/duplex


def _pick(rng: random.Random, ids: list[str], fallback: str) -> str:
    return rng.choice(ids[-4:]) if ids else fallback


def _well_formed(rng: random.Random, seen: Seen) -> tuple[dict[str, Any], set[str]]:
    """A well-formed event and the codes its state may refuse it with (§1.7's state-dependent codes)."""
    rid, iid = _pick(rng, seen.response_ids, "resp_none"), _pick(rng, seen.item_ids, "item_none")
    busy = {"input_backpressure"}
    choices: list[tuple[dict[str, Any], set[str]]] = [
        (append(rng.choice((20, 100, 200, 400)), rate=rng.choice(RATES)), busy),
        (append(rng.choice((20, 100, 200, 400)), rate=16000), busy),
        (append(100, final=True), busy),
        (append(100, is_speech=rng.random() < 0.5), busy),
        (append(100, overlap_action=rng.choice(("barge_in", "listen", "drop"))), busy),
        (append(200, video_frames=[camera_frame(640, 480, 1)]), busy),
        (append(200, video_frames=[camera_frame(448, 448, 2, "PNG"), camera_frame(320, 240, 3)]), busy),
        ({"type": "input_audio_buffer.commit"}, busy | {"input_audio_buffer_empty"}),
        ({"type": "input_audio_buffer.commit", "response_create": True},
         busy | {"input_audio_buffer_empty", "response_already_active"}),
        ({"type": "input_audio_buffer.clear"}, set()),
        ({"type": "input.cancel"}, set()),
        ({"type": "response.create"}, {"response_already_active", "response_create_without_input"}),
        ({"type": "response.cancel"}, {"response_not_active"}),
        ({"type": "response.cancel", "response_id": rid}, {"response_not_active"}),
        ({"type": "output_audio_buffer.clear"}, set()),
        ({"type": "barge_in"}, {"response_not_active"}),
        ({"type": "turn.signal", "event": rng.choice(("user_started", "assistant_done", "timeout"))}, set()),
        ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": pcm16_b64(300)}]}},
         busy | {"bad_event", "response_already_active"}),  # bad_event: an input item is open (§3.1)
        ({"type": "conversation.item.retrieve", "item_id": iid}, {"item_not_found"}),
        ({"type": "conversation.item.delete", "item_id": iid}, {"item_not_found", "bad_event"}),
        ({"type": "conversation.item.truncate", "item_id": iid, "content_index": 0,
          "audio_end_ms": rng.choice((0, 50, 400))}, {"item_not_found", "item_not_truncatable", "bad_event"}),
        ({"type": "playback.ack", "response_id": rid, "played_ms": rng.choice((0, 100, 900))}, {"item_not_found"}),
        ({"type": "playback.ack", "response_id": rid, "played_ms": rng.choice((0, 100, 900)), "truncate": True},
         {"item_not_found", "bad_event"}),  # bad_event: a truncate past the audio sent (§7.4 TR-1)
        ({"type": "session.update", "session": {"instructions": rng.choice(("Be brief.", "Be kind."))}},
         {"instructions_update_after_audio_unsupported"}),
        ({"type": "session.update", "session": {"output_modalities": [rng.choice(("text", "audio"))]}}, set()),
        ({"type": "session.update", "session": {"ref_audio": tone_clip(hz=rng.choice((220, 330)))}},
         {"ref_audio_update_unsupported"}),  # locked at the prefix commit (section 2.7)
        ({"type": "session.heartbeat"}, set()),
        ({"type": "session.event_ack", "server_event_seq": rng.randint(0, seen.last_seq)}, set()),
    ]
    return rng.choice(choices)


async def _read(c: Client, seen: Seen) -> None:
    """Record what arrives on `c` until the socket closes or the task is cancelled. (Not `Client.recv`: on Python
    3.11 its `asyncio.wait_for` can swallow a cancel that comes as a message does, and the task then waits on.)"""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            ev = json.loads(await c.ws.recv())
            c.events.append(ev)
            _learn(seen, ev)


async def random_client(addr: str, path: str, seed: int, frames: int = FRAMES, faults: FakeRuntime | None = None,
                        api_key: str | None = None, resumes: bool = False) -> list[dict[str, Any]]:
    """Send `frames` random frames on a new session at `addr`, then a heartbeat and a close; check the stream.
    With `faults`, now and then one of that runtime's next append, cancel or update fails (`FAULTS`). With
    `resumes` (/v1/realtime), now and then the socket drops and a new one resumes the session (§6.4) from the last
    event received: the attachments' streams, joined, are checked as one."""
    rng = random.Random(seed)
    seen = Seen()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with contextlib.AsyncExitStack() as sockets:
        c = await sockets.enter_async_context(connect(addr, path, headers=headers))
        if path == "/v1/duplex":
            await c.send({"type": "session.update", "session": {}})  # the native opener (no autostart)
        reader = asyncio.create_task(_read(c, seen))
        earlier: list[dict[str, Any]] = []  # the events of the attachments dropped before `c`'s
        allowed: dict[str, tuple[dict[str, Any], set[str]]] = {}  # client event_id -> (the well-formed frame,
        # the codes it may be refused with)
        must: dict[str, str] = {}  # client event_id -> the one code it must get
        unnamed: list[str] = []  # the codes of bad frames with no event_id the error could echo
        for i in range(frames):
            eid = f"f{i}"
            if rng.random() < 0.3:
                _, frame, code = rng.choice(BAD)
                if isinstance(frame, str) or len(frame.get("event_id", "")) > 128:
                    unnamed.append(code)  # no event_id to echo: not JSON, or the id itself is the fault
                    await c.send(frame)
                    continue
                must[eid] = code
                await c.send(dict(frame, event_id=eid))
            else:
                frame, codes = _well_formed(rng, seen)
                if faults is not None:
                    codes = codes | {FAULTS["update"][1]} if frame["type"] == "session.update" else codes
                allowed[eid] = frame, codes
                await c.send(dict(frame, event_id=eid))
            if faults is not None and rng.random() < 0.05:
                op = rng.choice(sorted(FAULTS))
                faults.fail[op] = FAULTS[op][0]
            if resumes and rng.random() < 0.03:
                await _stop(reader)
                old, c = c, await _resume(addr, c, earlier, seen, sockets, headers)
                earlier += old.events
                reader = asyncio.create_task(_read(c, seen))
            if rng.random() < 0.3:
                await asyncio.sleep(rng.choice((0.01, 0.05, 0.2)))
        await c.send({"type": "session.heartbeat", "event_id": "alive"})
        await _until(c, "session.heartbeat_ack")
        await c.send({"type": "session.close", "event_id": "bye"})
        await _until(c, "session.closed")
        await _stop(reader)
    events = earlier + c.events
    reported = {FAULTS["append"][1], FAULTS["cancel"][1]} if faults is not None else set()
    _check(events, path, allowed, must, unnamed, reported)
    return events


async def _resume(addr: str, c: Client, earlier: list[dict[str, Any]], seen: Seen,
                  sockets: contextlib.AsyncExitStack, headers: dict[str, str] | None) -> Client:
    """Drop `c` (no session.close) once every frame sent on it is answered, and resume on a new socket from the last
    sequenced event received; returns the new client, its `session.resumed` read."""
    # a retrieve goes through the session's FIFO mailbox and writer, so its answer (here a refusal naming this
    # barrier) comes after every earlier frame's; a rejection not yet written when the socket drops would be lost
    # with it (unsequenced, §1.4)
    barrier = f"barrier-{len(earlier) + len(c.events)}"
    await c.send({"type": "conversation.item.retrieve", "item_id": "item_barrier", "event_id": barrier})
    while not (c.events and c.events[-1]["type"] == "error" and error_of(c.events[-1])[1] == barrier):
        _learn(seen, await c.recv())
    opened = next(e for e in reversed(earlier + c.events) if e["type"] in ("session.created", "session.resumed"))
    token = opened["resume_token"]
    session_id = opened["session"]["id"] if opened["type"] == "session.created" else opened["session_id"]
    cursor = max((e["server_event_seq"] for e in earlier + c.events if "server_event_seq" in e), default=0)
    # close while reading on: with its receive queue full the client stops reading the socket, never sees the
    # server's close frame and gives up after its close timeout (10 s); what comes now is replayed after `cursor`
    drain = asyncio.create_task(_discard(c.ws))
    await c.ws.close()
    await drain
    new = await sockets.enter_async_context(connect(addr, "/v1/realtime?resume=1", headers=headers))
    await new.send({"type": "session.resume", "session_id": session_id, "resume_token": token,
                    "last_received_server_event_seq": cursor})
    resumed = await new.recv()
    assert resumed["type"] == "session.resumed" and resumed["replay_from_seq"] == cursor + 1, (
        resumed, [e["type"] for e in c.events[-8:]])
    return new


async def _discard(ws: websockets.ClientConnection) -> None:
    with contextlib.suppress(websockets.ConnectionClosed):
        async for _ in ws:
            pass


async def _stop(reader: asyncio.Task[None]) -> None:
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader


async def _until(c: Client, type_: str) -> None:
    """`type_` among what the reader recorded on `c`, within 10 s."""
    async def arrived() -> bool:
        return any(e["type"] == type_ for e in c.events)

    try:
        await eventually(arrived, wait_s=10, every_s=0.02)
    except TimeoutError:
        raise AssertionError(f"no {type_} within 10 s; last events: {[e['type'] for e in c.events[-20:]]}") from None


def _short(frame: dict[str, Any]) -> dict[str, Any]:
    return {k: v if not isinstance(v, str) or len(v) < 80 else v[:20] + "..." for k, v in frame.items()}


def _check(events: list[dict], path: str, allowed: dict[str, tuple[dict[str, Any], set[str]]],
           must: dict[str, str], unnamed: list[str], reported: set[str]) -> None:
    """`reported`: codes of errors that name no frame and may come (a runtime fault's report, §1.7)."""
    got: dict[str, list[str]] = {}
    messages: dict[str, dict[str, Any]] = {}  # client event_id -> its error event (for the failure's message)
    reports: list[dict[str, Any]] = []  # errors that name no frame
    for ev in events:
        if ev["type"] != "error":
            continue
        code, eid = error_of(ev)
        assert code in CODES, ev
        if eid is None:
            reports.append(ev)
        else:
            got.setdefault(eid, []).append(code)
            messages[eid] = ev
    for eid, code in must.items():
        assert got.get(eid) == [code], (eid, code, got.get(eid))
    for eid, codes in got.items():
        if eid in allowed:
            frame, may = allowed[eid]
            assert len(codes) == 1 and codes[0] in may, (eid, codes, may, _short(frame), messages[eid])
    # every other refusal names its frame
    unreported = [ev for ev in reports if error_of(ev)[0] not in reported]
    assert sorted(error_of(ev)[0] for ev in unreported) == sorted(unnamed), (unreported, unnamed)
    closed = [i for i, e in enumerate(events) if e["type"] in ("session.closed", "session.expired")]
    assert closed == [len(events) - 1] and events[-1]["reason"] == "client_close", events[-1]
    if path == "/v1/realtime":  # the checker reads the OpenAI shapes; the native dialect folds them (§3.3)
        assert_conformant(events)


def main(argv: list[str] | None = None) -> int:
    """Sweep seeds against a running gateway; each round runs `--concurrent` clients at once, routes in turn."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--addr", required=True, help="the gateway's HOST:PORT")
    ap.add_argument("--seeds", default="0-20", help="A-B: seeds A..B-1")
    ap.add_argument("--frames", type=int, default=FRAMES)
    ap.add_argument("--concurrent", type=int, default=1, help="clients at once (the gateway's max_sessions or fewer)")
    ap.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer` (a keyed gateway)")
    ap.add_argument("--resumes", action="store_true",
                    help="/v1/realtime clients drop their socket now and then and resume the session (section 6.4); "
                         "needs the gateway's disconnect grace well above the machine's pauses")
    args = ap.parse_args(argv)
    first, end = (int(x) for x in args.seeds.split("-"))
    paths = ("/v1/realtime", "/v1/duplex")
    failures = 0

    async def round_of(seed: int) -> list[BaseException | None]:
        return await asyncio.gather(*(random_client(args.addr, paths[(seed + k) % 2], seed + 1000 * k, args.frames,
                                                    api_key=args.api_key,
                                                    resumes=args.resumes and paths[(seed + k) % 2] == "/v1/realtime")
                                      for k in range(args.concurrent)), return_exceptions=True)

    for seed in range(first, end):
        for k, outcome in enumerate(asyncio.run(round_of(seed))):
            if isinstance(outcome, BaseException):
                failures += 1
                print(f"seed {seed + 1000 * k} {paths[(seed + k) % 2]}: FAILED", flush=True)
                traceback.print_exception(outcome, limit=2)
        print(f"seed {seed}: {args.concurrent} client(s) done, {failures} failure(s) so far", flush=True)
    print(f"{failures} failure(s) in {(end - first) * args.concurrent} runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
