"""A resume of a session this gateway still holds is relayed when another gateway now owns it (issue 20).

While a gateway was cut off from Redis past its lease, another gateway may have adopted its session; until the
ownership check fences the stale copy, a resume reaching the old owner must go to the new one, not be served
from the stale copy. One layer, with a fake directory (the real-process behaviour: tests/scaleout/test_scaleout.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.directory import relay
from gateway.directory.store import Entry
from gateway.protocol.errors import ProtocolError

SID, ME, OTHER = "sess_1", "10.0.0.1:8000", "10.0.0.2:8000"


class Directory:
    def __init__(self, entry: Entry | None, fail: bool = False) -> None:
        self.addr, self.entry, self.fail = ME, entry, fail

    async def lookup(self, sid: str) -> Entry | None:
        if self.fail:
            raise ConnectionError("redis down")
        return self.entry


def _gw(entry: Entry | None, fail: bool = False) -> Any:
    return SimpleNamespace(directory=Directory(entry, fail), sessions={SID: object()}, host_factory=None,
                           settings=SimpleNamespace(ws_max_message_bytes=1 << 20))


def _entry(owner: str, alive: bool = True) -> Entry:
    return Entry(SID, owner, "replica:8001", 7, 1, alive)


@pytest.fixture
def relayed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    async def fake_relay(ws: Any, owner: str, opener: dict[str, Any], *, max_size: int | None = None) -> None:
        calls.append(owner)

    monkeypatch.setattr(relay, "relay_resume", fake_relay)
    return calls


async def test_a_held_session_that_another_gateway_adopted_is_relayed_there(relayed: list[str]) -> None:
    assert await relay.relayed_to_owner(_gw(_entry(OTHER)), None, {"session_id": SID}) is True
    assert relayed == [OTHER]


async def test_a_held_session_this_gateway_still_owns_resumes_here(relayed: list[str]) -> None:
    assert await relay.relayed_to_owner(_gw(_entry(ME)), None, {"session_id": SID}) is False
    assert await relay.relayed_to_owner(_gw(None), None, {"session_id": SID}) is False
    assert relayed == []


async def test_an_unreachable_directory_is_a_retryable_resume_failure(relayed: list[str]) -> None:
    with pytest.raises(ProtocolError) as err:
        await relay.relayed_to_owner(_gw(None, fail=True), None, {"session_id": SID})
    assert err.value.code == "runtime_resume_failed" and relayed == []
