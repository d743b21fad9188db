"""Unit alignment (`unit_align_s`, gateway/session/units.py) through the real stack: tritonserver serving the tiny
checkpoint on CPU, the gateway, real WebSockets. tests/gateway/test_unit_align.py shows the same on the fake runtime.

With alignment on, the unit after a commit is cut short on the next shared tick (a multiple of the period on the
host's CLOCK_MONOTONIC, which the gateway and this test read alike) and the units after it hold one second of
audio each from that tick on; with it off, the units after a commit hold whole seconds of audio from the commit.

How a unit boundary shows from outside: an append with `force_listen: true` forces the unit its audio lands in to
listen, and stage0 reports that unit's decision as forced (`response.listen`, reason `force_listen`). The session
sends 300 ms of audio and commits it 0.3 s past a tick, then streams audio at real time in 100 ms chunks (each
sent at the end of its audio, as a microphone does) and marks the chunks 0.8-0.9 s, 1.8-1.9 s and 2.8-2.9 s after
the commit. The next tick is 0.7 s after the commit: aligned, unit 1 ends there and the marks land in units 2, 3
and 4; without alignment, unit 1 ends 1 s after the commit and the marks land in units 1, 2 and 3. Where a mark
lands follows from sample counts and from the order of the chunks against the tick, not from how fast the CPU
decides units, so a slow machine moves none of it.

Profile tests/e2e/profiles/scripted-align.yaml (the contrast stack serves it with DUPLEX_UNIT_ALIGN_S=0, which
overrides the profile): stage0 scripts one-unit turns, listen, listen, speak. With the first units' forced
listens off, unit 0 (the commit's) and unit 1 listen, unit 2's turn is forced away by a mark in both modes, and
unit 5 speaks and ends its turn: one response, which must complete with audio.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import REPO_ROOT, Stack
from tests.e2e.wire import RATE, assert_conformant, cleanup, close_session, collect_until, pcm16, silence
from tests.gateway_ops.wire import Raw, opened

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROFILE = REPO_ROOT / "tests" / "e2e" / "profiles" / "scripted-align.yaml"
PERIOD_S = 1.0  # the profile's unit_align_s
COMMIT_PHASE_S = 0.3  # the commit goes out this far past a tick: the next tick is 0.7 s of audio later
HEAD_MS = 300  # audio of the committed item (unit 0, padded at the commit)
CHUNK_MS = 100
CHUNK_S = CHUNK_MS / 1000
MARKS = (8, 18, 28)  # marked chunks after the commit: [0.8, 0.9) s, [1.8, 1.9) s, [2.8, 2.9) s of audio
ALIGNED_UNITS = [2, 3, 4]  # units from the tick: [0.7, 1.7) s, [1.7, 2.7) s, [2.7, 3.7) s
UNALIGNED_UNITS = [1, 2, 3]  # units from the commit: [0, 1) s, [1, 2) s, [2, 3) s
SPEAK_UNIT = 5  # the script's speak unit that no mark forces: aligned [3.7, 4.7) s, unaligned [4, 5) s
STREAM_CHUNKS = 50  # 5 s after the commit: unit 5 is complete in both modes
WAIT_S = 60.0  # the whole stream and the response on 2 shared cores
ENV = {"DUPLEX_FORCE_LISTEN_COUNT": "0"}  # the marks' units must not be forced for another reason


@dataclass(frozen=True)
class Run:
    """What one session saw: the client's clock readings and the events."""

    commit_at: float  # when the commit was sent (time.monotonic, as the gateway's clock)
    decided_at: dict[int, float]  # unit -> when its decision arrived (listen, or the first delta of a speak unit)
    events: list[dict[str, Any]]

    @property
    def tick(self) -> float:
        """The tick the gateway arms at the commit: the first after it (it handles the commit ms after it is sent)."""
        return (math.floor(self.commit_at / PERIOD_S) + 1) * PERIOD_S

    @property
    def forced(self) -> list[int]:
        """The units stage0 reports forced to listen, in order."""
        return [e["model_unit_index"] for e in self.events
                if e["type"] == "response.listen" and e["response"]["metadata"]["reason"] == "force_listen"]


def _decided_unit(ev: dict[str, Any]) -> int | None:
    if ev["type"] == "response.listen":
        return ev.get("model_unit_index")
    if ev["type"] in ("response.output_audio.delta", "response.output_text.delta"):
        return (ev.get("metadata") or {}).get("model_unit_index")
    return None


async def _append(c: Raw, ms: int, *, force_listen: bool = False) -> None:
    await c.send({"type": "input_audio_buffer.append", "audio": pcm16(silence(ms)), "sample_rate_hz": RATE,
                  "force_listen": force_listen})


async def _stream_marked(c: Raw, commit_at: float) -> None:
    """STREAM_CHUNKS of silence at real time from the commit; chunk i at the end of its audio, the MARKS forced."""
    for i in range(STREAM_CHUNKS):
        await asyncio.sleep(max(0.0, commit_at + (i + 1) * CHUNK_S - time.monotonic()))
        await _append(c, CHUNK_MS, force_listen=i in MARKS)


async def _read_until_done(c: Raw, decided_at: dict[int, float]) -> None:
    """Note when each unit's decision arrives, through the response's end."""
    def see(ev: dict[str, Any]) -> bool:
        unit = _decided_unit(ev)
        if unit is not None:
            decided_at.setdefault(unit, time.monotonic())
        return ev["type"] == "response.done"

    await collect_until(c, see, wait_s=WAIT_S)


async def _session(addr: str) -> Run:
    c, _ = await opened(addr)
    async with cleanup(c):
        await asyncio.sleep((COMMIT_PHASE_S - time.monotonic()) % PERIOD_S)
        await _append(c, HEAD_MS)
        commit_at = time.monotonic()
        await c.send({"type": "input_audio_buffer.commit"})
        decided_at: dict[int, float] = {}
        async with asyncio.TaskGroup() as tg:  # one reader, one writer: websockets allows a send beside a recv
            tg.create_task(_read_until_done(c, decided_at))
            tg.create_task(_stream_marked(c, commit_at))
        events = await close_session(c)
    return Run(commit_at, decided_at, events)


def _served(cache: Path, align: str, min_sessions: str = "") -> Run:
    """Start a stack on the profile (`align`: DUPLEX_UNIT_ALIGN_S, `min_sessions`: DUPLEX_UNIT_ALIGN_MIN_SESSIONS, ""
    for the profile's), run one session, and stop the stack in the background (the next stack starts meanwhile)."""
    env = {**ENV, "DUPLEX_UNIT_ALIGN_S": align, "DUPLEX_UNIT_ALIGN_MIN_SESSIONS": min_sessions}
    s = Stack(cache, profile=PROFILE, env=env, max_sessions=1)
    s.start()
    try:
        return asyncio.run(_session(s.addr))
    finally:
        s.stop_soon()


@pytest.fixture(scope="module")
def aligned(e2e_cache: Path) -> Run:
    return _served(e2e_cache, "")  # an empty value counts as unset: the profile's 1.0 holds


@pytest.fixture(scope="module")
def unaligned(e2e_cache: Path) -> Run:
    return _served(e2e_cache, "0")


@pytest.fixture(scope="module")
def below_floor(e2e_cache: Path) -> Run:
    return _served(e2e_cache, "", min_sessions="2")  # the profile's period, but aligned only from 2 live sessions


def test_the_unit_after_a_commit_is_cut_on_the_next_tick(aligned: Run) -> None:
    # the first mark, 0.1 s past the tick, is already in unit 2: unit 1 ended on the tick, 0.7 s after the commit
    assert aligned.forced == ALIGNED_UNITS, (aligned.forced, _times(aligned))
    # and it was cut on the tick, not at once: it cannot be decided before the tick
    assert aligned.decided_at[1] >= aligned.tick, _times(aligned)


def test_without_alignment_the_commit_does_not_move_the_grid(unaligned: Run) -> None:
    assert unaligned.forced == UNALIGNED_UNITS, (unaligned.forced, _times(unaligned))
    # unit k after the commit waits for k whole seconds of audio from it: none is decided sooner
    early = {k: t for k, t in unaligned.decided_at.items() if 1 <= k <= 4 and t < unaligned.commit_at + k}
    assert not early, _times(unaligned)


def test_below_its_floor_of_live_sessions_the_profile_does_not_align(below_floor: Run) -> None:
    """`unit_align_min_sessions` through `duplex serve`: one live session is below a floor of 2."""
    assert below_floor.forced == UNALIGNED_UNITS, (below_floor.forced, _times(below_floor))


@pytest.mark.parametrize("mode", ["aligned", "unaligned"])
def test_the_session_stays_conformant(mode: str, request: pytest.FixtureRequest) -> None:
    run: Run = request.getfixturevalue(mode)
    assert_conformant(run.events)
    done = [e for e in run.events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["completed"], done
    audio_units = {e["metadata"]["model_unit_index"] for e in run.events if e["type"] == "response.output_audio.delta"}
    assert audio_units == {SPEAK_UNIT}, audio_units
    assert set(range(SPEAK_UNIT + 1)) <= set(run.decided_at), _times(run)  # every unit decided, none skipped


def _times(run: Run) -> dict[str, Any]:
    """Diagnosis: decision arrival times relative to the tick."""
    return {"commit": round(run.commit_at - run.tick, 3),
            "decided": {u: round(t - run.tick, 3) for u, t in sorted(run.decided_at.items())}}
