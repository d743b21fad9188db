"""The resume procedure (protocol.md §6.4 RS1-RS9) as checks over a `ResumeTarget`, plus prepare/commit.

Usage (the ws handshake, on a `session.resume` opener):

    req = ResumeRequest.parse(fields)                                   # RS1
    target = lookup(req.session_id)
    start = check_resume(req, target, route=..., profile=...)           # RS2-RS6 (JournalGap for RS6)
    expected = leases.generation(req.session_id)                        # read before waiting (RS7)
    async with target.attachments.resume_lock:
        plan = prepare_resume(req, target, leases, expected, route=..., profile=...)  # RS7 CAS, replay, new token
        ... write session.resumed(plan) on the new socket ...
        takeover = commit_resume(target, plan, leases)                  # RS8, only after the write
        ... session.replaced to the old socket; replay plan.replay; then live events (RS9) ...

A failure before `commit_resume` changes nothing a client can see: the old token, the old socket or the
grace timer stay as they were (§6.4 last paragraph).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.leases import LeaseManager
from gateway.protocol.errors import Effect, ProtocolError
from gateway.resume.attachment import Attachments, AttachState, Takeover
from gateway.resume.credentials import ResumeCredential, Rotation
from gateway.resume.journal import Journal

RESUMABLE_STATES = ("open", "detached")


class ResumeTarget(Protocol):
    session_id: str
    incarnation: int
    route: str
    profile: str
    credential: ResumeCredential
    journal: Journal
    attachments: Attachments


def _hs(code: str, message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(code, message, param=param, effect=Effect.HANDSHAKE)


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    session_id: str
    resume_token: str = field(repr=False)
    last_received_server_event_seq: int
    incarnation: int | None = None

    @classmethod
    def parse(cls, fields: Mapping[str, Any]) -> ResumeRequest:
        """RS1: present and well-typed, cursor >= 0; else `invalid_session_resume`."""
        sid, token = fields.get("session_id"), fields.get("resume_token")
        cursor, inc = fields.get("last_received_server_event_seq"), fields.get("incarnation")
        if not isinstance(sid, str) or not sid:
            raise _hs("invalid_session_resume", "session_id is required", "session_id")
        if not isinstance(token, str) or not token:
            raise _hs("invalid_session_resume", "resume_token is required", "resume_token")
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise _hs("invalid_session_resume", "last_received_server_event_seq must be an integer >= 0",
                      "last_received_server_event_seq")
        if inc is not None and (isinstance(inc, bool) or not isinstance(inc, int) or inc < 1):
            raise _hs("invalid_session_resume", "incarnation must be an integer >= 1", "incarnation")
        return cls(sid, token, cursor, inc)


def check_resume(req: ResumeRequest, target: ResumeTarget | None, *, route: str, profile: str) -> int:
    """RS2-RS6 in order. Returns the first seq to replay. Raises ProtocolError, or JournalGap for RS6."""
    att = None if target is None else target.attachments
    if target is None or att is None or att.state is AttachState.CLOSED \
            or (req.incarnation is not None and req.incarnation != target.incarnation):
        raise _hs("session_resume_expired", "unknown, closed or expired session")  # must be open or detached (RS2)
    if not target.credential.verify(req.resume_token):
        raise _hs("invalid_resume_token", "resume token does not match")  # current or one-shot previous (RS3)
    if not att.resumable or target.journal.overflowed or route != target.route or profile != target.profile:
        raise _hs("unsupported_session_resume", "session is not resumable on this route/profile")  # same route and profile (RS4)
    # a cursor past the last assigned seq is invalid (RS5); a pruned seq after it is a journal gap (RS6)
    target.journal.check_cursor(req.last_received_server_event_seq)
    return req.last_received_server_event_seq + 1


@dataclass(frozen=True, slots=True)
class ResumePlan:
    session_id: str
    rotation: Rotation
    replay: tuple[bytes, ...]  # exact bytes, seq > cursor, in order (J-6)
    replay_from_seq: int
    last_server_event_seq: int

    def resumed_event(self, target: ResumeTarget, session_obj: dict[str, Any]) -> dict[str, Any]:
        """§2.9 `session.resumed` (unsequenced; carries the new token). Generation is the one after commit."""
        return {"type": "session.resumed", "session_id": self.session_id, "incarnation": target.incarnation,
                "attachment_generation": target.attachments.generation + 1,
                "resume_token": self.rotation.token, "last_server_event_seq": self.last_server_event_seq,
                "replay_from_seq": self.replay_from_seq, "replay_count": len(self.replay),
                "session": session_obj}


def prepare_resume(req: ResumeRequest, target: ResumeTarget, leases: LeaseManager, expected_generation: int,
                   *, route: str, profile: str) -> ResumePlan:
    """RS7 under `target.attachments.resume_lock`: re-check, compare-and-set the lease, build the plan."""
    start = check_resume(req, target, route=route, profile=profile)
    if not leases.compare_and_set(target.session_id, expected_generation):
        raise _hs("session_resume_conflict", "another resume of this session won")
    replay = tuple(target.journal.replay(req.last_received_server_event_seq))
    start = max(start, target.journal.acked_seq + 1)  # acknowledged seqs are gone and count as received (J-2)
    return ResumePlan(target.session_id, target.credential.prepare_rotation(), replay, start,
                      target.journal.last_seq)


def commit_resume(target: ResumeTarget, plan: ResumePlan, leases: LeaseManager) -> Takeover:
    """RS8 after `session.resumed` was written: takeover, generation + 1, token rotation, grace cancelled."""
    takeover = target.attachments.activate()
    target.credential.commit_rotation(plan.rotation)
    leases.attach(target.session_id)
    leases.touch(target.session_id)
    return takeover
