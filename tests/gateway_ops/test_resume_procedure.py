from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from gateway.leases import LeaseConfig, LeaseManager
from gateway.protocol.errors import ProtocolError
from gateway.resume.attachment import Attachments, AttachState, LossAction
from gateway.resume.credentials import ResumeCredential
from gateway.resume.journal import Journal, JournalConfig, JournalGap
from gateway.resume.procedure import ResumeRequest, check_resume, commit_resume, prepare_resume

from .conftest import FakeClock

ROUTE, PROFILE = "/v1/realtime", "ga"


@dataclass
class Target:
    session_id: str
    incarnation: int
    route: str
    profile: str
    credential: ResumeCredential
    journal: Journal
    attachments: Attachments = field(default_factory=lambda: Attachments(resumable=True))


def make(clock: FakeClock, n_events: int = 5) -> tuple[Target, str, LeaseManager, list[bytes]]:
    cred, token = ResumeCredential.issue()
    j = Journal(JournalConfig(60.0, 1 << 20), clock)
    sent = []
    for s in range(1, n_events + 1):
        data = f'{{"type":"x","server_event_seq":{s}}}'.encode()
        j.offer(s, data)
        sent.append(data)
    t = Target("sess_1", 1, ROUTE, PROFILE, cred, j)
    t.attachments.created_delivered = True
    leases = LeaseManager(LeaseConfig(300.0, 30.0, 5.0), clock)
    leases.add(t.session_id)
    return t, token, leases, sent


def req(token: str, cursor: int = 3, **kw: object) -> ResumeRequest:
    return ResumeRequest.parse({"session_id": "sess_1", "resume_token": token,
                                "last_received_server_event_seq": cursor, **kw})


@pytest.mark.parametrize("fields", [
    {}, {"session_id": "s"}, {"session_id": "s", "resume_token": "t"},
    {"session_id": "s", "resume_token": "t", "last_received_server_event_seq": -1},
    {"session_id": "s", "resume_token": "t", "last_received_server_event_seq": "3"},
    {"session_id": "s", "resume_token": "t", "last_received_server_event_seq": True},
    {"session_id": "s", "resume_token": "t", "last_received_server_event_seq": 0, "incarnation": 0},
])
def test_rs1_invalid_fields(fields: dict) -> None:
    with pytest.raises(ProtocolError) as ei:
        ResumeRequest.parse(fields)
    assert ei.value.code == "invalid_session_resume"


def test_request_repr_hides_token() -> None:
    assert "secret-token" not in repr(req("secret-token"))


def test_check_order_rs2_to_rs6(clock: FakeClock) -> None:
    t, token, _, _ = make(clock)

    def code(r: ResumeRequest, target: Target | None = t, route: str = ROUTE, profile: str = PROFILE) -> str:
        with pytest.raises(ProtocolError) as ei:
            check_resume(r, target, route=route, profile=profile)
        return ei.value.code

    assert code(req(token), target=None) == "session_resume_expired"
    assert code(req(token, incarnation=2)) == "session_resume_expired"
    assert code(req("A" * 43)) == "invalid_resume_token"
    assert code(req(token), route="/v1/duplex") == "unsupported_session_resume"
    assert code(req(token), profile="beta") == "unsupported_session_resume"
    assert code(req(token, cursor=6)) == "invalid_session_resume"
    assert check_resume(req(token), t, route=ROUTE, profile=PROFILE) == 4
    t.attachments.close()
    assert code(req(token)) == "session_resume_expired"


def test_rs4_after_journal_overflow(clock: FakeClock) -> None:
    t, token, _, _ = make(clock)
    t.journal.offer(6, b"x" * (2 << 20))  # overflow
    with pytest.raises(ProtocolError) as ei:
        check_resume(req(token), t, route=ROUTE, profile=PROFILE)
    assert ei.value.code == "unsupported_session_resume"


def test_rs6_gap(clock: FakeClock) -> None:
    t, token, _, _ = make(clock)
    clock.advance(61.0)
    with pytest.raises(JournalGap):
        check_resume(req(token, cursor=3), t, route=ROUTE, profile=PROFILE)


async def test_resume_of_detached_session(clock: FakeClock) -> None:
    t, token, leases, sent = make(clock)
    assert t.attachments.on_socket_lost(1).action is LossAction.DETACH
    leases.detach(t.session_id)
    r = req(token, cursor=3)
    expected = leases.generation(t.session_id)
    async with t.attachments.resume_lock:
        plan = prepare_resume(r, t, leases, expected, route=ROUTE, profile=PROFILE)
        event = plan.resumed_event(t, {"id": "sess_1"})
        assert event["attachment_generation"] == 2 and event["replay_from_seq"] == 4
        assert event["replay_count"] == 2 and event["last_server_event_seq"] == 5
        assert event["resume_token"] == plan.rotation.token != token
        takeover = commit_resume(t, plan, leases)
    assert list(plan.replay) == sent[3:]
    assert takeover.replaced_generation is None and takeover.new_generation == 2
    assert takeover.replaced_event("sess_1") is None
    assert t.attachments.is_current(2) and not t.attachments.is_current(1)
    assert leases.expires_in(t.session_id) == pytest.approx(300.0)  # grace timer cancelled
    assert t.credential.verify(plan.rotation.token) and t.credential.verify(token)  # one-shot old token
    t.credential.first_frame_received()
    assert not t.credential.verify(token)


async def test_takeover_of_live_socket(clock: FakeClock) -> None:
    t, token, leases, _ = make(clock)
    expected = leases.generation(t.session_id)
    async with t.attachments.resume_lock:
        plan = prepare_resume(req(token, 5), t, leases, expected, route=ROUTE, profile=PROFILE)
        takeover = commit_resume(t, plan, leases)
    assert takeover.replaced_event("sess_1") == {"type": "session.replaced", "session_id": "sess_1",
                                                 "attachment_generation": 1, "reason": "takeover"}
    assert not t.attachments.is_current(1)  # frames and writes from the replaced socket are rejected
    assert t.attachments.on_socket_lost(1).action is LossAction.IGNORE  # TK-4 late detach is a no-op
    assert t.attachments.state is AttachState.ATTACHED


async def test_concurrent_resumes_have_one_winner(clock: FakeClock) -> None:
    t, token, leases, _ = make(clock)
    results: list[str] = []

    async def attempt() -> None:
        expected = leases.generation(t.session_id)  # read before waiting on the lock
        await asyncio.sleep(0)
        async with t.attachments.resume_lock:
            try:
                plan = prepare_resume(req(token, 5), t, leases, expected, route=ROUTE, profile=PROFILE)
            except ProtocolError as err:
                results.append(err.code)
                return
            await asyncio.sleep(0.01)  # the write of session.resumed
            commit_resume(t, plan, leases)
            results.append("ok")

    await asyncio.gather(attempt(), attempt())
    assert sorted(results) == ["ok", "session_resume_conflict"]
    assert t.attachments.generation == 2


async def test_failed_write_changes_nothing_visible(clock: FakeClock) -> None:
    t, token, leases, _ = make(clock)
    expected = leases.generation(t.session_id)
    async with t.attachments.resume_lock:
        plan = prepare_resume(req(token, 5), t, leases, expected, route=ROUTE, profile=PROFILE)
        # session.resumed could not be written -> no commit_resume
    assert t.attachments.is_current(1) and t.credential.verify(token)
    assert not t.credential.verify(plan.rotation.token)


def test_attachment_loss_outcomes() -> None:
    a = Attachments(resumable=True)
    assert a.on_socket_lost(1).reason == "session_created_undelivered"
    b = Attachments(resumable=False)
    b.created_delivered = True
    out = b.on_socket_lost(1, transport_error=True)
    assert out.action is LossAction.CLOSE and out.reason == "transport_error"
    c = Attachments(resumable=False)
    c.created_delivered = True
    assert c.on_socket_lost(1).reason == "disconnect"
    d = Attachments(resumable=True)
    d.created_delivered = True
    assert d.on_socket_lost(1).action is LossAction.DETACH
    assert d.on_socket_lost(1).action is LossAction.IGNORE
    out = d.mark_unresumable()
    assert out.action is LossAction.CLOSE and out.reason == "journal_overflow"
    with pytest.raises(RuntimeError):
        d.activate()
