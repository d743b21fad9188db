import random

from clients.resume import ACK_EVERY_EVENTS, ResumeCredentials, SeqTracker, backoff_delays


def test_seq_tracker_drops_replayed_duplicates() -> None:
    t = SeqTracker()
    assert all(t.accept(s) for s in (1, 2, 3))
    assert t.accept(None)  # unsequenced events are never deduplicated
    assert not t.accept(2) and not t.accept(3)  # replay after resume: already processed
    assert t.accept(4) and t.highest == 4


def test_ack_pacing_every_second_or_32_events() -> None:
    t = SeqTracker()
    assert t.ack_due(0.0) is None
    t.accept(1)
    assert t.ack_due(0.5) is None  # the clock starts at the first unacked event
    assert t.ack_due(1.6) == 1
    t.mark_acked(1, 1.6)
    for s in range(2, 2 + ACK_EVERY_EVENTS):
        t.accept(s)
    assert t.ack_due(1.7) == 1 + ACK_EVERY_EVENTS
    t.mark_acked(1 + ACK_EVERY_EVENTS, 1.7)
    assert t.ack_due(5.0) is None  # nothing new


def test_resume_frame_and_backoff_bounds() -> None:
    frame = ResumeCredentials("sess_1", "tok", 2).resume_frame(212)
    assert frame == {"type": "session.resume", "session_id": "sess_1", "resume_token": "tok",
                     "last_received_server_event_seq": 212, "incarnation": 2}
    assert "incarnation" not in ResumeCredentials("s", "t", None).resume_frame(0)
    delays = list(backoff_delays(random.Random(3)))
    assert len(delays) == 5
    for n, d in enumerate(delays):
        assert 0.25 <= d <= min(4.0, 0.25 * 2 ** n)
