"""The ops modules together, as the wiring doc connects them: detach -> grace expiry -> cleanup -> slot."""
from __future__ import annotations

import pytest

from gateway.admission import Admission, AdmissionConfig, SlotState
from gateway.leases import ExpiryReason, LeaseConfig, LeaseManager, Reaper
from gateway.observability import GatewayMetrics
from gateway.protocol.errors import ProtocolError
from gateway.resume.attachment import Attachments, LossAction
from gateway.resume.credentials import ResumeCredential
from gateway.resume.journal import Journal, JournalConfig
from gateway.resume.procedure import ResumeRequest, check_resume

from .conftest import FakeClock


class FakeTarget:
    def __init__(self, clock: FakeClock) -> None:
        self.session_id, self.incarnation, self.route, self.profile = "s1", 1, "/v1/duplex", "native"
        self.credential, self.token = ResumeCredential.issue()
        self.journal = Journal(JournalConfig(60.0, 1 << 20), clock)
        self.attachments = Attachments(resumable=True)
        self.attachments.created_delivered = True


async def test_grace_expiry_frees_slot_only_after_cleanup_and_resume_expires(clock: FakeClock) -> None:
    metrics = GatewayMetrics(1, process_defaults=False)
    adm = Admission(AdmissionConfig(1, retry_base_s=1.0, retry_max_s=5.0), clock=clock,
                    on_change=metrics.set_session_counts)
    leases = LeaseManager(LeaseConfig(300.0, 30.0, 5.0), clock)
    t = FakeTarget(clock)
    adm.reserve(t.session_id)
    leases.add(t.session_id)

    triton_up = False
    cleanups = 0

    async def runtime_close() -> None:
        nonlocal cleanups
        cleanups += 1
        if not triton_up:
            raise ConnectionError("triton unreachable")

    async def on_expire(sid: str, reason: ExpiryReason) -> None:
        t.attachments.close()
        metrics.session_ended(reason.value)
        await adm.close(sid, runtime_close)

    reaper = Reaper(leases, on_expire, adm.retry_due)
    assert t.attachments.on_socket_lost(1).action is LossAction.DETACH
    leases.detach(t.session_id)
    adm.set_state(t.session_id, SlotState.DETACHED)
    assert adm.counts()["detached"] == 1

    clock.advance(30.0)
    await reaper.run_once()
    await reaper.settle()  # the expiry runs as its own tracked task
    assert cleanups == 1 and adm.state_of(t.session_id) is SlotState.CLOSING
    with pytest.raises(ProtocolError) as ei:  # the slot is still held while cleanup is pending
        adm.reserve("s2")
    assert ei.value.code == "resource_exhausted"

    req = ResumeRequest.parse({"session_id": "s1", "resume_token": t.token, "last_received_server_event_seq": 0})
    with pytest.raises(ProtocolError) as ei:
        check_resume(req, t, route="/v1/duplex", profile="native")
    assert ei.value.code == "session_resume_expired"

    triton_up = True  # Triton comes back: the reaper's retry frees the slot
    clock.advance(1.0)
    await reaper.run_once()
    assert cleanups == 2 and len(adm) == 0
    adm.reserve("s2")
    body = metrics.render()[0].decode()
    assert 'duplex_sessions_ended_total{reason="disconnect_grace_expired"} 1.0' in body
    assert 'duplex_sessions{state="open"} 1.0' in body
    await reaper.aclose()
