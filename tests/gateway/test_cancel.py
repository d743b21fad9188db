"""Cancellation triggers, fences and epochs (protocol.md §3.6, §4.4, §8.4 B1-B3, Appendix B "Cancel")."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.runtime.base import RuntimeFailure
from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units, types


async def _speaking(c, rt) -> str:  # noqa: ANN001
    rt.plan[1] = Speak("one two ", 1000)
    for u in range(2, 8):
        rt.plan[u] = Speak("more ", 1000)
    await stream_units(c, 2)
    got = await c.until("response.output_audio.delta")
    got.append(await c.recv())  # the pair's transcript half: unit 1 is all out
    assert got[-1]["type"] == "response.output_audio_transcript.delta"
    return next(e for e in got if e["type"] == "response.created")["response"]["id"]


def _cancels(rt) -> list:  # noqa: ANN001
    return [op[1] for op in rt.ops if op[0] == "cancel"]


async def test_output_clear_active_cancels_with_cleared_first() -> None:
    async with session() as (c, rt):
        rid = await _speaking(c, rt)
        await c.send({"type": "output_audio_buffer.clear"})
        got = await c.until("rate_limits.updated")
        events = await close(c)
    t = types(got)
    assert t[0] == "output_audio_buffer.cleared" and got[0]["response_id"] == rid
    done = got[-2]["response"]
    assert done["duplex"]["reason"] == "output_cleared" and done["status_details"]["reason"] == "client_cancelled"
    assert [(f.epoch, n.epoch) for f, n in _cancels(rt)] == [(0, 1)]
    assert_conformant(events)


async def test_output_clear_idle_no_epoch_change() -> None:
    async with session() as (c, rt):
        await c.send({"type": "output_audio_buffer.clear"})  # no response has carried audio: nothing at all
        assert await c.quiet(0.2) == []
        rt.plan[1] = Speak("hi", 500, end_of_turn=True)
        await stream_units(c, 2)
        got = await c.until("rate_limits.updated")
        rid = next(e for e in got if e["type"] == "response.created")["response"]["id"]
        await c.send({"type": "output_audio_buffer.clear"})
        cleared = await c.until("output_audio_buffer.cleared")
        events = await close(c)
    assert cleared[-1]["response_id"] == rid and _cancels(rt) == []  # F-6: no cancel, no epoch change
    assert_conformant(events)


async def test_barge_in_event_and_new_turn() -> None:
    async with session() as (c, rt):
        rid = await _speaking(c, rt)
        await c.send({"type": "barge_in", "source": "client"})
        got = await c.until("rate_limits.updated")
        events = await close(c)
    assert types(got)[0] == "output_audio_buffer.cleared" and "overlap.decision" not in types(got)  # no K1
    done = got[-2]["response"]
    assert done["id"] == rid and done["duplex"]["reason"] == "barge_in"
    assert_conformant(events)


async def test_append_overlap_action_barge_in_emits_k1() -> None:
    async with session() as (c, rt):
        await _speaking(c, rt)
        await c.send(append(200, overlap_action="interrupt"))
        got = await c.until("rate_limits.updated")
        events = await close(c)
    t = types(got)
    assert t.index("overlap.decision") < t.index("output_audio_buffer.cleared") < t.index("response.done")
    k1 = got[t.index("overlap.decision")]
    assert k1["action"] == "barge_in" and k1["reason"] == "client_overlap_action"
    assert_conformant(events)


async def test_input_cancel_advances_epoch_exactly_once() -> None:
    async with session() as (c, rt):
        await c.send(append(300))
        await c.send({"type": "input.cancel"})
        idle = await c.until("input_audio_buffer.cleared")
        assert idle[-1]["metadata"] == {"epoch": 1, "item_id": idle[0]["item_id"], "reason": "input_cancel"}
        await _speaking(c, rt)
        await c.send({"type": "input.cancel"})
        got = await c.until("input_audio_buffer.cleared")
        events = await close(c)
    done = next(e for e in got if e["type"] == "response.done")["response"]
    assert done["duplex"]["reason"] == "input_cancelled" and done["duplex"]["epoch"] == 1
    assert got[-1]["metadata"]["epoch"] == 2 and types(got).index("rate_limits.updated") < len(got) - 1
    assert [(f.epoch, n.epoch) for f, n in _cancels(rt)] == [(0, 1), (1, 2)]
    assert_conformant(events)


async def test_fence_rejects_old_epoch_appends_and_cancel_closes_turn() -> None:
    async with session() as (c, rt):
        rid = await _speaking(c, rt)
        await c.send({"type": "response.cancel", "response_id": rid})
        await c.until("rate_limits.updated")
        await c.send({"type": "response.cancel", "response_id": rid})  # T-3: terminal already; not active
        err = await c.until("error")
        await stream_units_more(c, 3)
        later = await c.until("response.created")
        events = await close(c)
    assert err[-1]["error"]["code"] == "response_not_active"
    appends = [op[1] for op in rt.ops if op[0] == "append"]
    post = [f.epoch for f, _, _, _ in appends[2:]]
    assert post and all(e == 1 for e in post)  # every later append carries the new fence
    # F-5: the first unit after the cancel was force-listened by the runtime; then a new response opened
    assert any(e["type"] == "response.listen" and e["response"]["metadata"]["reason"] == "force_listen"
               for e in later)
    created = later[-1]["response"]
    assert created["id"] != rid and created["duplex"]["epoch"] == 1
    assert_conformant(events)


async def stream_units_more(c, units: int) -> None:  # noqa: ANN001
    for _ in range(units * 5):
        await c.send(append(200))


async def test_silence_continuation_keeps_model_speaking() -> None:
    async with session(unit_deadline_grace_s=0.05) as (c, rt):
        rt.plan[1] = Speak("a ", 1000)
        rt.plan[2] = Speak("b.", 500, end_of_turn=True)
        await stream_units(c, 2)  # the client then falls silent mid-response
        got = await c.until("rate_limits.updated", wait_s=4)
        events = await close(c)
    synthetic = [op[1] for op in rt.ops if op[0] == "append" and op[1][3]]
    assert synthetic and synthetic[0][1] == 2  # unit 2 was completed with silence at its deadline (U-3)
    assert next(e for e in got if e["type"] == "response.done")["response"]["duplex"]["reason"] == "turn_end"
    assert_conformant(events)


async def test_no_silence_without_active_response() -> None:
    async with session(unit_deadline_grace_s=0.05) as (c, rt):
        await c.send(append(500))
        await c.quiet(1.5)
        events = await close(c)
    assert [op for op in rt.ops if op[0] == "append"] == []  # U-6
    assert_conformant(events)


class SlowCancelRuntime(FakeRuntime):
    """A runtime whose cancel takes a while to adopt the next epoch (three stage calls over gRPC) and whose update
    refuses a fence it has not adopted yet, as stage0 does (`InvalidFenceError`: "epoch N was never adopted")."""

    async def cancel(self, key: Any, fence: Any, next_fence: Any) -> None:  # noqa: ANN401 - FakeRuntime's signature
        await asyncio.sleep(0.3)
        await super().cancel(key, fence, next_fence)

    async def update(self, key: Any, fence: Any, config: Any) -> None:  # noqa: ANN401 - FakeRuntime's signature
        if fence.epoch > self.seqs[key.correlation_id].epoch:
            raise RuntimeFailure("invalid_fence", f"epoch {fence.epoch} was never adopted")
        await super().update(key, fence, config)


async def test_an_update_after_a_cancel_waits_for_the_runtime_to_adopt_the_epoch() -> None:
    """§2.7 U3 / §4.4 F-6: the update carries the new epoch, so it goes to the runtime only after the cancel that
    advanced it (found by tests/e2e/test_random_client.py: `runtime_update_failed`, "epoch 6 was never adopted")."""
    async with session(SlowCancelRuntime()) as (c, rt):
        await c.send({"type": "input.cancel"})  # idle: still advances the epoch and sends the cancel
        await c.send({"type": "session.update", "event_id": "u", "session": {"output_modalities": ["text"]}})
        answer = await c.recv()
        while answer["type"] not in ("session.updated", "error"):
            answer = await c.recv()
        events = await close(c)
    assert answer["type"] == "session.updated", answer
    assert [op[0] for op in rt.ops if op[0] in ("cancel", "update")] == ["cancel", "update"]
    assert [f.epoch for op, f in rt.ops if op == "update"] == [1]
    assert_conformant(events)
