"""Overlap policies and barge-in without VAD (protocol.md §8.3, §8.4 B1-B3)."""

from __future__ import annotations

import pytest

from gateway.vad.overlap import OverlapChunk, OverlapEpisode
from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


@pytest.mark.parametrize(("policy", "speech", "ms", "expect"), [
    ("listen_only", True, 5000, ("listen", "auto_response_continuous")),
    ("auto", False, 5000, ("ignore", "non_speech")),
    ("auto", True, 700, ("listen", "short_overlap")),
    ("auto", True, 701, ("listen", "overlap_pending")),
    ("auto", True, 1200, ("barge_in", "long_overlap_speech")),
    ("barge_in_on_speech", True, 1199, ("listen", "overlap_pending")),
    ("barge_in_on_speech", True, 1200, ("barge_in", "long_overlap_speech")),
])
def test_policy_table(policy: str, speech: bool, ms: float, expect: tuple[str, str]) -> None:
    episode = OverlapEpisode()
    if not speech:  # an episode with earlier speech, then this silent chunk
        episode.decide(OverlapChunk(True, ms), policy=policy, short_ack_ms=700, barge_in_ms=1200)
    d = episode.decide(OverlapChunk(speech, ms if speech else 20), policy=policy, short_ack_ms=700, barge_in_ms=1200)
    assert (d.action, d.reason) == expect


async def _speaking(c, rt) -> None:  # noqa: ANN001
    rt.plan[1] = Speak("one ", 1000)
    for u in range(2, 9):
        rt.plan[u] = Speak("more ", 1000)
    await stream_units(c, 2)
    await c.until("response.speak")


async def test_auto_policy_barges_in_on_long_overlap() -> None:
    async with session(update={"overlap_policy": "auto"}) as (c, rt):
        await _speaking(c, rt)
        for _ in range(7):
            await c.send(append(200))
        got = await c.until("rate_limits.updated")
        events = await close(c)
    decisions = [(e["action"], e["reason"]) for e in got if e["type"] == "overlap.decision"]
    assert decisions == [("listen", "short_overlap"), ("listen", "overlap_pending"),
                         ("barge_in", "long_overlap_speech")]  # emitted only on change (§8.3)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["duplex"]["reason"] == "turn_detected" and done["status_details"]["reason"] == "turn_detected"
    t = types(got)
    assert t.index("output_audio_buffer.cleared") < t.index("response.done")
    assert_conformant(events)


async def test_drop_verdict_replaces_chunk_with_silence() -> None:
    async with session() as (c, rt):
        await _speaking(c, rt)
        for _ in range(5):
            await c.send(append(200, overlap_action="ignore"))  # the client's drop group
        got = await c.until("overlap.decision")
        got += await c.quiet(0.3)
        events = await close(c)
    d = got[-1] if got[-1]["type"] == "overlap.decision" else next(e for e in got if e["type"] == "overlap.decision")
    assert d["action"] == "drop" and d["metadata"]["buffer_audio"] is False
    assert [e for e in got if e["type"] == "overlap.decision"] == [d]  # one decision per episode change
    assert not any(rt.units_seen[2].pcm[i] for i in range(0, 4 * 16000, 997))  # unit 2 is silence
    assert_conformant(events)


async def test_barge_in_on_a_response_still_playing_truncates_history() -> None:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Short answer.", 1000, end_of_turn=True)
        await stream_units(c, 2)
        got = await c.until("rate_limits.updated")
        rid = next(e for e in got if e["type"] == "response.created")["response"]["id"]
        await c.send(append(200, force_barge_in=True))
        b3 = await c.until("conversation.item.truncated")
        events = await close(c)
    t = types(b3)
    assert t[-3:] == ["overlap.decision", "output_audio_buffer.cleared", "conversation.item.truncated"]
    assert b3[-2]["response_id"] == rid and "response.done" not in t
    assert [op for op in rt.ops if op[0] == "cancel"] == []  # B3: no epoch change, no runtime call
    assert_conformant(events)
