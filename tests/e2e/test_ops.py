"""Issue 7 through the real stack: admission, resume/takeover/grace, backpressure, VAD and barge-in.

The scenario functions of tests/gateway_ops (written to take only an address) run unchanged here; the ones that
need a fake runtime's switches (hold, plans) are rewritten for a real runtime.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.stack import MAX_SESSIONS, OPS_ENV, Stack, profile_engine
from tests.e2e.wire import (
    RATE,
    WAIT_S,
    cleanup,
    collect_until,
    fit_units,
    pcm16,
    send_audio,
    silence,
    types,
    unit_decided,
)
from tests.gateway_ops.test_wired_admission import scenario_capacity
from tests.gateway_ops.test_wired_resume import (
    scenario_grace_expiry,
    scenario_resume_replays_and_rotates,
    scenario_takeover,
)
from tests.gateway_ops.test_wired_vad import VAD_ON, scenario_vad_speech_vs_silence
from tests.gateway_ops.wire import http_get, metric, opened

pytestmark = pytest.mark.e2e

# the stack test_close_backlog shares: a short disconnect grace (the grace-expiry scenario waits it out), a fast
# reaper, a pending-input limit of ~62 s of 16 kHz pcm16 (a 70 s append never fits; the ~6 s bursts of the VAD
# scenario do). Counters are read before and after each scenario: other modules' sessions ran on this gateway.
STACK_ENV = OPS_ENV
PENDING_LIMIT_BYTES = int(STACK_ENV["DUPLEX_MAX_PENDING_INPUT_BYTES_PER_SESSION"])
OVERSIZED_MS = 70_000
assert OVERSIZED_MS * RATE // 1000 * 2 > PENDING_LIMIT_BYTES
LOOPBACK = profile_engine().endswith("loopback")


async def test_capacity_refuses_n_plus_one_then_admits(addr: str) -> None:
    caps = (await http_get(addr, "/v1/duplex/capabilities")).json()
    assert caps["limits"]["max_sessions"] == MAX_SESSIONS  # --max-sessions reached the gateway
    await scenario_capacity(addr, MAX_SESSIONS)


async def _counter(addr: str, name: str, **labels: str) -> float:
    return metric((await http_get(addr, "/metrics")).text, name, **labels)


async def test_resume_replays_byte_exact_and_rotates_token(addr: str) -> None:
    before = await _counter(addr, "duplex_resume_total", result="ok")
    await scenario_resume_replays_and_rotates(addr)
    assert await _counter(addr, "duplex_resume_total", result="ok") >= before + 1


async def test_takeover(addr: str) -> None:
    await scenario_takeover(addr)


@pytest.mark.timeout(60)
async def test_grace_expiry_gives_session_resume_expired(addr: str) -> None:
    before = await _counter(addr, "duplex_sessions_ended_total", reason="disconnect_grace_expired")
    await scenario_grace_expiry(addr)
    assert await _counter(addr, "duplex_sessions_ended_total", reason="disconnect_grace_expired") >= before + 1


async def test_backpressure_rejects_before_any_state_change(addr: str) -> None:
    before = await _counter(addr, "duplex_input_backpressure_total", kind="bytes")
    c, _ = await opened(addr)
    async with cleanup(c):
        await c.send({"type": "session.update", "session": {"turn_detection": None}})
        await c.until("session.updated", WAIT_S)
        await send_audio(c, silence(200), pace=0)
        await c.quiet(0.3)
        seen = len(c.events)
        big = pcm16(silence(OVERSIZED_MS))
        await c.send({"type": "input_audio_buffer.append", "audio": big, "sample_rate_hz": RATE, "event_id": "big"})
        err = await c.until("error", WAIT_S)
        assert err["error"]["code"] == "input_backpressure" and err["error"]["event_id"] == "big"
        assert err["error"]["type"] == "rate_limit_error" and "server_event_seq" not in err
        await c.quiet(0.3)
        assert c.events[seen:] == [err]  # the rejection emitted nothing else
        await c.send({"type": "input_audio_buffer.commit"})
        committed = await c.until("input_audio_buffer.committed", WAIT_S)
        md = committed["metadata"]
        assert md["audio_end_ms"] - md["audio_start_ms"] == 200  # the rejected append left no trace
    assert await _counter(addr, "duplex_input_backpressure_total", kind="bytes") >= before + 1


@pytest.mark.timeout(60)
async def test_vad_on_speech_vs_silence(addr: str, speech: np.ndarray) -> None:
    await scenario_vad_speech_vs_silence(addr, speech)
    c, _ = await opened(addr)  # silence alone: no speech events, no commit
    async with cleanup(c):
        await c.send({"type": "session.update", "session": {"turn_detection": VAD_ON}})
        await c.until("session.updated", WAIT_S)
        await send_audio(c, fit_units(silence(0), 2), pace=0.25)
        await collect_until(c, lambda e: unit_decided(e, 1))  # the tiny random model may even speak on silence
        kinds = set(types(c.events))
        assert not kinds & {"input_audio_buffer.speech_started", "input_audio_buffer.committed"}


@pytest.mark.timeout(60)
async def test_vad_barge_in_stops_the_audio(addr: str, speech: np.ndarray) -> None:
    before = await _counter(addr, "duplex_barge_in_total", source="vad")
    c, _ = await opened(addr)
    async with cleanup(c):
        await c.send({"type": "session.update", "session": {"turn_detection": VAD_ON}})
        await c.until("session.updated", WAIT_S)
        tone = (0.2 * np.sin(np.arange(RATE * 2030 // 1000) * 0.07)).astype(np.float32)  # loud, but no speech
        await send_audio(c, tone, pace=0.25)
        try:
            first = await collect_until(c, lambda e: e["type"] == "response.output_audio.delta")
        except TimeoutError:
            if LOOPBACK:
                raise
            pytest.skip("the tiny random model did not speak within two loud units")
        await send_audio(c, speech[: RATE], pace=0.25)
        decision = await collect_until(c, lambda e: e["type"] == "overlap.decision" and e["action"] == "barge_in")
        assert decision["reason"] == "server_vad_utterance_active"
        done = await collect_until(c, lambda e: e["type"] == "response.done")
        assert done["response"]["id"] == first["response_id"] and done["response"]["status"] == "cancelled"
        assert done["response"]["duplex"]["reason"] == "turn_detected"
        cut = c.events.index(done)
        assert "output_audio_buffer.cleared" in types(c.events[:cut])
        await send_audio(c, silence(1000), pace=0.25)
        await c.quiet(1.0)
        late = [e for e in c.events[cut:] if e["type"] == "response.output_audio.delta"
                and e["response_id"] == first["response_id"]]
        assert late == []  # barge-in stopped the audio of the cancelled response
    assert await _counter(addr, "duplex_barge_in_total", source="vad") >= before + 1


def test_stack_processes(stack: Stack) -> None:
    """The launcher started a real tritonserver under it (not an in-process stand-in)."""
    assert stack.tritonserver_pid() is not None and stack.triton_ready()
