"""A session closed with a backlog of input sent faster than real time frees its slot (found by bench/soak.py).

The close drops the input not yet sent to the runtime and waits for the unit in flight (§3.10 X4;
tests/gateway/test_close_and_runtime_death.py: a backlog alone no longer delays it). When that one unit
outlasts `close_ack_timeout_s`, the first cleanup attempt times out, the close stops the lane, and every retry
used to wait for a queue that nobody ran any more: the slot stayed `closing` forever and the server refused
everyone with `resource_exhausted`. A stopped lane now counts as drained, so the retry closes.
"""

from __future__ import annotations

import base64

import numpy as np

from tests.gateway.fake_runtime import FakeRuntime
from tests.gateway.harness import serve
from tests.gateway_ops.test_wired_admission import refusal
from tests.gateway_ops.wire import eventually, opened

RATE = 16000
UNITS = 12


def _pcm16(seconds: float) -> str:
    x = np.random.default_rng(0).normal(0, 0.05, int(RATE * seconds))
    return base64.b64encode((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def test_close_with_a_backlog_frees_the_slot() -> None:
    rt = FakeRuntime()
    rt.append_delay_s = 1.5  # one unit takes longer than close_ack_timeout_s; 12 s of audio sent at once
    async with serve(rt, max_sessions=1, close_ack_timeout_s=1.0, cleanup_retry_base_s=0.1) as addr:
        c, _ = await opened(addr)
        for _ in range(UNITS):
            await c.send({"type": "input_audio_buffer.append", "audio": _pcm16(1.0), "sample_rate_hz": RATE})
        await c.send({"type": "session.close"})
        closed = await c.until("session.closed")
        assert closed["cleanup_pending"] is True, closed  # the first attempt ran out of time on the unit in flight
        await c.ws.close()

        async def admitted() -> bool:
            return (await refusal(addr))[0] == "admitted"

        await eventually(admitted, 10.0, every_s=0.2)
        appended = [op for op in rt.ops if op[0] == "append"]
        assert len(appended) < UNITS  # what the lane had not sent when it stopped was never sent
        assert "close" in [op[0] for op in rt.ops]  # the runtime was closed, not left to its idle expiry
