"""The test servers' port allocator (tests/ports.py): disjoint per xdist worker, outside the ephemeral range."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def test_worker_blocks_are_disjoint_and_below_the_ephemeral_range() -> None:
    blocks = [set(ports.worker_block(f"gw{i}", "3", 32_768)) for i in range(3)]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2]) and not (blocks[0] & blocks[2])
    widened = [{p + k for p in b for k in range(ports.STRIDE)} for b in blocks]  # the derived ports too
    assert not (widened[0] & widened[1]) and not (widened[1] & widened[2])
    assert all(ports.LOW <= p and p + ports.STRIDE - 1 < 32_768 for b in blocks for p in b)
    assert min(len(b) for b in blocks) > 1_500
    assert set(ports.worker_block(None, None, 32_768)) == set(ports.worker_block("gw0", "1", 32_768))


def test_a_small_room_under_the_ephemeral_range_falls_back_above_low() -> None:
    block = ports.worker_block("gw1", "2", 1_024)
    assert len(block) > 2_000 and min(block) >= ports.LOW


def test_ports_are_never_repeated_and_skip_a_taken_block(monkeypatch: pytest.MonkeyPatch) -> None:
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    spare = ports.free_port()  # this worker's own block, below the ephemeral range: no outgoing connection lands there
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", got[-1]))
        taken = got[-1]
        monkeypatch.setattr(ports, "_next", iter([taken - 3, taken, spare]))
        assert ports.free_port() == spare  # taken-3 and taken both cover the bound port
