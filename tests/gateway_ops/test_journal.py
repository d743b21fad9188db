from __future__ import annotations

import json

import pytest

from gateway.protocol.errors import ProtocolError
from gateway.resume.journal import Journal, JournalConfig, JournalGap, Sequencer, resync_required_event

from .conftest import FakeClock


def frame(seq: int, body: str = "x") -> bytes:
    # Non-ASCII content: replay must be byte-exact, not re-serialised.
    return json.dumps({"type": "response.output_audio_transcript.delta", "server_event_seq": seq,
                       "delta": f"{body}é{seq}"}, ensure_ascii=False, separators=(",", ":")).encode()


def fill(j: Journal, n: int) -> list[bytes]:
    out = []
    for s in range(j.next_seq, j.next_seq + n):
        data = frame(s)
        assert j.offer(s, data)
        out.append(data)
    return out


def test_replay_is_byte_exact_from_cursor(clock: FakeClock) -> None:
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    sent = fill(j, 5)
    assert j.replay(2) == sent[2:]
    assert j.replay(5) == [] and j.replay(0) == sent
    assert j.last_seq == 5


def test_offer_requires_contiguous_seq(clock: FakeClock) -> None:
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    fill(j, 1)
    with pytest.raises(ValueError):
        j.offer(3, b"{}")


def test_ack_trims_and_is_max_monotonic(clock: FakeClock) -> None:
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    sent = fill(j, 4)
    j.ack(2)
    assert len(j) == 2 and j.retained_bytes == sum(map(len, sent[2:]))
    j.ack(1)  # lower ack changes nothing
    assert len(j) == 2 and j.acked_seq == 2
    # a cursor below the ack is fine: acknowledged seqs count as received (J-5)
    assert j.replay(1) == sent[2:]


@pytest.mark.parametrize("bad", [5, -1, "3", 2.0, True, None])
def test_invalid_ack(clock: FakeClock, bad: object) -> None:
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    fill(j, 4)
    with pytest.raises(ProtocolError) as ei:
        j.ack(bad)
    assert ei.value.code == "invalid_event_ack"


def test_ttl_prune_and_journal_gap(clock: FakeClock) -> None:
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    fill(j, 2)
    clock.advance(30.0)
    sent = fill(j, 2)  # seqs 3, 4
    clock.advance(30.5)  # seqs 1, 2 are now older than the TTL
    assert j.prune() == 2
    assert j.replay(2) == sent  # nothing missing after seq 2
    with pytest.raises(JournalGap):
        j.replay(1)  # seq 2 was pruned but the client never got it
    j.ack(2)
    assert j.replay(1) == sent  # ... unless it acknowledged it


def test_cursor_beyond_last_seq(clock: FakeClock) -> None:
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    fill(j, 3)
    with pytest.raises(ProtocolError) as ei:
        j.check_cursor(4)
    assert ei.value.code == "invalid_session_resume"


def test_byte_cap_overflow_stops_journaling(clock: FakeClock) -> None:
    one = len(frame(1))
    j = Journal(JournalConfig(60.0, 3 * one), clock)
    fill(j, 3)
    assert not j.offer(4, frame(4))
    assert j.overflowed and not j.sequencing and j.last_seq == 3
    assert not j.offer(4, frame(4))  # stays off for good
    j.ack(3)  # acks up to the last assigned seq stay valid


def test_ttl_prune_runs_before_the_cap_check(clock: FakeClock) -> None:
    one = len(frame(1))
    j = Journal(JournalConfig(10.0, 2 * one), clock)
    fill(j, 2)
    clock.advance(11.0)
    assert j.offer(3, frame(3))  # the aged entries make room first; not an overflow


def test_sequencer_sends_resync_before_first_unsequenced(clock: FakeClock) -> None:
    one = len(frame(1))
    j = Journal(JournalConfig(60.0, 2 * one), clock)
    overflows = []
    seq = Sequencer(j, lambda last: json.dumps(resync_required_event("s", "journal_overflow", last)),
                    on_overflow=lambda: overflows.append(1))

    def make(body: str):  # noqa: ANN202
        def f(s: int | None) -> str:
            ev: dict[str, object] = {"type": "t", "delta": body}
            if s is not None:
                ev["server_event_seq"] = s
            return json.dumps(ev)
        return f

    a = seq.frames(make("aaaaaaaaaaaaaaaaaaa"), sequenced=True)
    b = seq.frames(make("b"), sequenced=True)
    c = seq.frames(make("c" * 200), sequenced=True)  # overflows
    d = seq.frames(make("d"), sequenced=True)
    u = seq.frames(make("u"), sequenced=False)
    assert json.loads(a[0])["server_event_seq"] == 1 and json.loads(b[0])["server_event_seq"] == 2
    assert [json.loads(x)["type"] for x in c] == ["session.resync_required", "t"]
    assert json.loads(c[0]) == {"type": "session.resync_required", "session_id": "s", "reason": "journal_overflow",
                                "last_server_event_seq": 2}
    assert "server_event_seq" not in json.loads(c[1]) and "server_event_seq" not in json.loads(d[0])
    assert "server_event_seq" not in json.loads(u[0])
    assert overflows == [1] and seq.last_seq == 2
