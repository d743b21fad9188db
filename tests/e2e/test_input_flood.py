"""Issue 18 point 3: audio far faster than real time, through the real tritonserver + gateway.

A client sent 24 appends of 1 MiB of PCM16 each (13 minutes of audio in a few seconds, every frame within the
limits). Stage0 queued every unit, the session's KV write later failed with `IndexError: index 4262 is out of
bounds` and its cleanup never finished, so the admission slot leaked. Input ahead of real time must be pushed
back with a typed error (`input_backpressure` at the gateway, `runtime_backpressure` from stage0's queue cap),
the session must go on, and its close must free the slot.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.stack import Stack, profile_path
from tests.e2e.wire import WAIT_S, collect_until
from tests.gateway_ops.test_wired_admission import admits
from tests.gateway_ops.wire import eventually, http_get, metric, opened

pytestmark = pytest.mark.e2e

APPENDS = 24
APPEND_BYTES = 1 << 20  # PCM16: 32.8 s of audio per append, within max_frame_bytes
PUSHBACK = {"input_backpressure", "runtime_backpressure"}
CLOSE_ACK_TIMEOUT_S = 5.0
KV_WINDOW = 128  # a small KV window: the flood's units pass it, and evict, within seconds
WORK_S = 15.0  # stage0 decides ~10 units in that time on 2 CPU cores: several windows' worth of positions


def _small_window_profile(folder: Path) -> Path:
    lines = [f"kv_window: {KV_WINDOW}" if line.partition(":")[0].strip() == "kv_window" else line
             for line in profile_path().read_text().splitlines()]
    out = folder / "small-window.yaml"
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def one_slot(e2e_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One admission slot (a leaked one refuses the next session) and a small KV window."""
    profile = _small_window_profile(tmp_path_factory.mktemp("profile"))
    s = Stack(e2e_cache, profile=profile, max_sessions=1,
              env={"DUPLEX_READY_CACHE_S": "0", "DUPLEX_FORCE_LISTEN_COUNT": "0",
                   "DUPLEX_CLOSE_ACK_TIMEOUT_S": str(CLOSE_ACK_TIMEOUT_S)})
    s.start()
    try:
        yield s
    finally:
        s.stop_soon()


def _noise_append(rng: np.random.Generator) -> dict[str, object]:
    pcm = (rng.normal(0, 0.05, APPEND_BYTES // 2).clip(-1, 1) * 32767).astype("<i2")
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode(),
            "sample_rate_hz": 16000}


# the module's stack starts inside the test's time; with two suites side by side on the 2 cores the whole took
# over the default 90 s (alone: about 27 s)
@pytest.mark.timeout(240)
async def test_a_flood_of_audio_is_pushed_back_typed_and_leaks_nothing(one_slot: Stack) -> None:
    addr = one_slot.addr
    c, _ = await opened(addr)
    rng = np.random.default_rng(0)
    for _ in range(APPENDS):
        await c.send(_noise_append(rng))
    await collect_until(c, lambda e: e["type"] == "error" and e["error"]["code"] in PUSHBACK, WAIT_S)
    pushed_back = len(c.events)
    # stage0 works through the queued units for a while, past its small KV window (evicting old units): any
    # error but the push-back ends the wait (an IndexError in the KV write arrives as internal_error)
    with contextlib.suppress(TimeoutError):
        await collect_until(c, lambda e: e["type"] == "error" and e["error"]["code"] not in PUSHBACK, WORK_S)
    assert len(c.events) > pushed_back  # the session went on after the push-back
    await c.send({"type": "session.close"})
    closed = await collect_until(c, lambda e: e["type"] == "session.closed", WAIT_S)
    codes = {e["error"]["code"] for e in c.events if e["type"] == "error"}
    assert codes <= PUSHBACK, codes  # no internal_error (the IndexError), no runtime_close_failed
    assert closed["cleanup_pending"] is False, closed
    await c.ws.close()
    await eventually(lambda: admits(addr), WAIT_S)  # the slot is free
    text = (await http_get(addr, "/metrics")).text
    assert sum(metric(text, "duplex_sessions", state=st) for st in ("open", "detached", "closing")) == 0
