"""Mailbox and writer properties (protocol.md §1.3, §3.9): FIFO, exactly once, control never overtakes data,
aliases normalised on admission, stale-epoch deltas dropped at send time."""

from __future__ import annotations

import asyncio
import json

from gateway.protocol.profiles import Profile, Projector
from gateway.resume.journal import Journal, JournalConfig, Sequencer
from gateway.session.outbox import Kind, Outbox, OutboxLimits, OutItem
from gateway.ws.writer import Writer
from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


async def test_fifo_and_exactly_once_with_interleaved_errors() -> None:
    async with session() as (c, rt):
        for i in range(40):
            if i % 4 == 3:
                await c.send({"type": "conversation.item.retrieve", "item_id": f"item_{i}", "event_id": f"e{i}"})
            else:
                await c.send(append(103))
        got = [await c.recv() for _ in range(11)]  # speech_started + 10 errors (listens may interleave)
        while len([e for e in got if e["type"] == "error"]) < 10:
            got.append(await c.recv())
        events = await close(c)
    errs = [e["error"]["event_id"] for e in got if e["type"] == "error"]
    assert errs == [f"e{i}" for i in range(3, 40, 4)]  # each rejected exactly once, in arrival order
    # 30 appends x 103 ms = 3090 ms = 3 model units exactly, each submitted once, in order
    assert [u.unit_index for u in rt.units_seen] == [0, 1, 2]
    assert_conformant(events)


async def test_clear_never_overtakes_earlier_appends() -> None:
    async with session() as (c, rt):
        for _ in range(5):
            await c.send(append(100))
        await c.send({"type": "input_audio_buffer.clear"})
        got = await c.until("input_audio_buffer.cleared")
        events = await close(c)
    started = next(e for e in got if e["type"] == "input_audio_buffer.speech_started")
    cleared = got[-1]
    # the clear saw the item the earlier appends opened
    assert cleared["metadata"]["item_id"] == started["item_id"] and cleared["metadata"]["reason"] == "clear"
    assert_conformant(events)


async def test_close_is_processed_after_earlier_appends() -> None:
    async with session() as (c, rt):
        for _ in range(11):
            await c.send(append(100))  # 1100 ms: unit 0 complete
        await c.send({"type": "session.close"})
        got = await c.until("session.closed")
    # X1: the close saw what the earlier appends did (their item opened before it)
    assert "input_audio_buffer.speech_started" in [e["type"] for e in got]
    # X4: the runtime close follows every append sent to the runtime; input not sent yet is dropped, not run
    assert [u.unit_index for u in rt.units_seen] in ([], [0])
    ops = [op[0] for op in rt.ops]
    assert ops[-1] == "close" and ops.count("close") == 1
    assert got[-1]["reason"] == "client_close"


async def test_aliases_normalised_once() -> None:
    async with session(path="/v1/duplex", update={}) as (c, rt):
        await c.send({"type": "push_chunk", "audio": "", "video_frames": None, "event_id": "p"})  # legacy alias
        err = await c.recv()
        await c.send({"type": "audio.playback_ack", "response_id": "resp_none", "played_ms": 0, "event_id": "a"})
        err2 = await c.recv()
        await c.send({"type": "signal_turn", "event": "user_started"})
        ev = await c.recv()
        await c.send({"type": "close_session"})
        closed = await c.until("session.closed")
    # native route: flat errors (§1.6)
    assert err["code"] == "bad_audio" and err["client_event_id"] == "p" and isinstance(err["error"], str)
    assert err2["code"] == "item_not_found"
    assert ev["type"] == "turn.event" and ev["event"] == "user_started"
    assert closed[-1]["reason"] == "client_close"


async def test_turn_signal_redispatch_cancels_once() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("x ", 1000)
        rt.plan[2] = Speak("y ", 1000)
        await stream_units(c, 2)
        await c.until("response.speak")
        await c.send({"type": "turn.signal", "event": "response.cancel", "payload": {}})
        got = await c.until("rate_limits.updated")
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled" and len([op for op in rt.ops if op[0] == "cancel"]) == 1
    assert_conformant(events)


class _Sock:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send_text(self, data: str) -> None:
        self.sent.append(json.loads(data))

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.sent.append({"closed": code})


async def test_writer_drops_stale_epoch_pairs_as_a_unit_without_consuming_seq() -> None:
    outbox = Outbox(OutboxLimits(1 << 20, 100, 1024, 4))
    epoch = {"now": 0}
    sock = _Sock()
    dropped: list[str] = []
    journal = Journal(JournalConfig(60.0, 1 << 20))
    w = Writer(outbox, Projector(Profile.GA), Sequencer(journal, lambda last: "{}"),
               is_stale=lambda it: it.kind is Kind.STREAM and it.epoch is not None and it.epoch < epoch["now"],
               on_drop=dropped.append)
    pair = ({"type": "response.output_audio.delta", "response_id": "r", "delta": ""},
            {"type": "response.output_audio_transcript.delta", "response_id": "r", "delta": "a"})
    outbox.put(OutItem(events=({"type": "x.before"},)))
    outbox.put(OutItem(events=pair, kind=Kind.STREAM, epoch=0, response_id="r"))
    outbox.put(OutItem(events=({"type": "x.after"},), close=(1000, "done")))
    epoch["now"] = 1  # a cancellation accepted after the pair was queued, before it was sent
    w.attach(sock, 1)
    await asyncio.wait_for(w.run(), 1)
    assert [e.get("type") for e in sock.sent[:-1]] == ["x.before", "x.after"]
    assert [e["server_event_seq"] for e in sock.sent[:-1]] == [1, 2]  # S-2: no seq consumed by the drop
    assert dropped == ["response.output_audio.delta", "response.output_audio_transcript.delta"]
    assert len(journal) == 2  # J-1: both sequenced events were journaled


async def test_stale_runtime_output_after_cancel_never_reaches_the_client() -> None:
    """Late epoch-0 output injected after the cancel is rejected at acceptance (T-2) and never sent."""
    from gateway.runtime.base import AudioPiece, Decision, TextPiece, UnitDone
    from tests.gateway.fake_runtime import tone, unit_metrics

    async with session() as (c, rt):
        rt.plan[1] = Speak("first ", 1000)
        await stream_units(c, 2)
        await c.until("response.output_audio_transcript.delta")
        await c.send({"type": "response.cancel"})
        await c.until("rate_limits.updated")
        corr = next(iter(rt.seqs))
        for ev in (Decision(epoch=0, unit=7, action="speak"), TextPiece(epoch=0, unit=7, text="ghost"),
                   AudioPiece(epoch=0, unit=7, seq=0, pcm16=tone(200)),
                   UnitDone(epoch=0, unit=7, is_listen=False, end_of_turn=True, metrics=unit_metrics(1))):
            rt.inject(corr, ev)
        later = await c.quiet(0.3)
        events = await close(c)
    assert "response.created" not in types(later) and "ghost" not in json.dumps(events)
    assert_conformant(events)
