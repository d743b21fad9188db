"""The seeded random client (tests/gateway/random_client.py) against the real gateway app with the fake runtime, on
real WebSockets: beside it a second session talks and must get the same responses as when it talks alone; with
runtime faults injected, each fault must reach the client as its typed error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.gateway import random_client as random_client_module
from tests.gateway.fake_runtime import FakeRuntime, Speak
from tests.gateway.harness import connect, serve
from tests.gateway.random_client import BAD, FAULTS, STATE_FREE, error_of, random_client
from tests.gateway.scenario import assert_conformant, stream_units


async def _bystander(addr: str, units: int) -> list[tuple[str, str]]:
    """A plain session: `units` units of audio at a steady pace, then a close; returns its responses (status and
    transcript) in order."""
    async with connect(addr) as c:
        await c.recv()  # session.created
        for _ in range(units):
            await stream_units(c, 1, chunk_ms=100)
            await asyncio.sleep(0.05)
        await c.send({"type": "session.close"})
        await c.until("session.closed", wait_s=10)
    assert not [e for e in c.events if e["type"] == "error"], c.events
    assert_conformant(c.events)
    done = [e["response"] for e in c.events if e["type"] == "response.done"]
    return [(r["status"], "".join(p.get("transcript", "") for o in r["output"] for p in o.get("content", [])))
            for r in done]


def _runtime() -> FakeRuntime:
    rt = FakeRuntime()
    rt.plan = {u: Speak(f"unit {u} ", 300, end_of_turn=u % 2 == 1) for u in range(400)}
    return rt


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/duplex"])
async def test_random_frames_get_typed_errors_and_leave_the_session_and_its_neighbour_whole(path: str,
                                                                                          seed: int) -> None:
    async with serve(_runtime()) as addr:
        alone = await _bystander(addr, 4)
    assert alone, "the bystander's script makes responses"
    async with serve(_runtime(), max_sessions=2) as addr:
        _, beside = await asyncio.gather(random_client(addr, path, seed), _bystander(addr, 4))
    assert beside == alone


@pytest.mark.parametrize("seed", [4, 5])
async def test_runtime_faults_among_random_frames_are_typed_and_leave_the_session_whole(seed: int) -> None:
    """The same with the runtime failing an append, cancel or update now and then: each failure reaches the client
    as its typed error (a report, or the refused update's own), nothing else changes, and the session goes on."""
    rt = _runtime()
    async with serve(rt) as addr:
        events = await random_client(addr, "/v1/realtime", seed, faults=rt)
    faults = {code for _, code in FAULTS.values()}
    assert any(error_of(ev)[0] in faults for ev in events if ev["type"] == "error")  # some fault did reach it


@pytest.mark.parametrize("seed", [6, 7])
async def test_random_frames_across_dropped_and_resumed_sockets(seed: int) -> None:
    """The same with the socket dropped now and then and the session resumed on a new one (§6.4): the replay fills
    the gap, so the attachments' streams joined are one conformant stream, and every answer is still there."""
    async with serve(_runtime()) as addr:
        events = await random_client(addr, "/v1/realtime", seed, resumes=True)
    assert sum(e["type"] == "session.resumed" for e in events) >= 3  # it did drop and resume


async def test_the_sweep_resumes_its_realtime_clients(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m tests.gateway.random_client --resumes`, the operators' sweep (docs/deploy.md): /v1/realtime
    clients drop and resume their sockets, /v1/duplex clients run as without the flag."""
    resumed: dict[str, int] = {}

    async def counting(addr: str, path: str, seed: int, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        events = await random_client(addr, path, seed, *args, **kwargs)
        resumed[path] = sum(e["type"] == "session.resumed" for e in events)
        return events

    monkeypatch.setattr(random_client_module, "random_client", counting)
    async with serve(_runtime(), max_sessions=2) as addr:
        code = await asyncio.to_thread(random_client_module.main,
                                       ["--addr", addr, "--seeds", "6-7", "--concurrent", "2", "--resumes"])
    assert code == 0 and capsys.readouterr().out.splitlines()[-1] == "0 failure(s) in 2 runs"
    assert resumed["/v1/realtime"] >= 3 and resumed["/v1/duplex"] == 0, resumed


def test_the_bad_frames_cover_the_state_free_cases() -> None:
    assert {name for name, _, _ in BAD} == STATE_FREE  # a case renamed in test_errors_frames.py is not lost here
