"""Units put on a shared tick after a commit (`unit_align_s`, gateway/session/units.py), on real WebSockets with
the fake runtime: the unit after the commit is cut short on the tick and the next one follows a second later."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session

PERIOD_S = 0.5


class TimedRuntime(FakeRuntime):
    """Notes the gateway clock's time (time.monotonic) of every append."""

    def __init__(self) -> None:
        super().__init__()
        self.append_times: dict[int, float] = {}
        self.commit_sent_at = 0.0  # the client's clock just before it sent the commit

    async def append(self, key: Any, fence: Any, unit: Any) -> None:  # noqa: ANN401 - FakeRuntime's signature
        self.append_times[unit.unit_index] = time.monotonic()
        await super().append(key, fence, unit)


async def _stream(c: Any, seconds: float, chunk_ms: int = 100) -> None:  # noqa: ANN401 - the harness client
    """Audio at real time, as a microphone sends it."""
    for _ in range(int(seconds * 1000 / chunk_ms)):
        await c.send(append(chunk_ms))
        await asyncio.sleep(chunk_ms / 1000)


async def _commit_then_stream(seconds: float, **settings: Any) -> tuple[TimedRuntime, float, list[dict]]:
    """300 ms of audio, a commit (its unit padded at once), then `seconds` of audio at real time; returns the
    runtime, the commit unit's append time and the session's events."""
    rt = TimedRuntime()
    async with session(rt, **settings) as (c, rt):
        rt.plan[0] = Speak("Hi!", 600, end_of_turn=True)
        await c.send(append(300))
        rt.commit_sent_at = time.monotonic()
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("conversation.item.done")
        committed_at = rt.append_times[0]
        await _stream(c, seconds)
        events = await close(c)
    return rt, committed_at, events


def _tick_of(rt: TimedRuntime, committed_at: float, cut_at: float) -> float:
    """The shared tick the gateway armed: the first one after it handled the commit, somewhere between the
    client's send and the commit unit's append. When that span crosses a tick, both ticks are candidates and the
    cut time tells which; a cut near neither fails (chunks arrive every 100 ms, so the cut is < 0.3 s after)."""
    candidates = {(t // PERIOD_S + 1) * PERIOD_S for t in (rt.commit_sent_at, committed_at)}
    near = [tick for tick in candidates if tick <= cut_at < tick + 0.3]
    assert near, f"unit cut at {cut_at:.3f}, ticks {sorted(candidates)}"
    return near[0]


async def test_the_unit_after_a_commit_ends_on_the_shared_tick() -> None:
    rt, committed_at, events = await _commit_then_stream(2.4, unit_align_s=PERIOD_S)
    short, after = rt.append_times[1], rt.append_times[2]
    tick = _tick_of(rt, committed_at, short)  # cut on the first tick after the commit
    assert 0.85 < after - tick < 1.6  # unit 2: one second of audio after the tick
    units = {u.unit_index: u for u in rt.units_seen}
    assert len(units[1].pcm) == len(units[2].pcm) == 16000 * 4  # full units (float32 bytes), the short one padded
    assert_conformant(events)


async def test_without_alignment_the_unit_after_a_commit_takes_a_whole_second() -> None:
    rt, committed_at, events = await _commit_then_stream(1.4)
    assert 0.9 < rt.append_times[1] - committed_at < 1.4
    assert_conformant(events)


async def test_alignment_waits_for_its_number_of_live_sessions() -> None:
    """`unit_align_min_sessions`: this session alone is one live session, so a floor of 2 leaves its units on their
    own second and a floor of 1 puts them on the tick."""
    rt, committed_at, events = await _commit_then_stream(1.4, unit_align_s=PERIOD_S, unit_align_min_sessions=2)
    assert 0.9 < rt.append_times[1] - committed_at < 1.4
    assert_conformant(events)
    rt, committed_at, events = await _commit_then_stream(1.4, unit_align_s=PERIOD_S, unit_align_min_sessions=1)
    _tick_of(rt, committed_at, rt.append_times[1])
    assert_conformant(events)
