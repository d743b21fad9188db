"""Adoption: a resume reaches this gateway for a session whose gateway died; this gateway takes it over.

Once the dead owner's lease has run out, the first gateway a resume reaches takes the session's record over
(`SessionDirectory.take_over`, atomic: one gateway wins, and the sweep cannot close it meanwhile), rebuilds the
session from what its owner wrote through (replica.py: config, state, journal, credential digests, attachment
generation), binds it to its Triton sequence on its replica again, and hosts it detached. The resume then runs
as on one gateway (RS1-RS9 in gateway/ws/resuming.py): token checked and rotated, the journal replayed byte for
byte, live events after.

The new owner's first runtime operation is a cancel to a new epoch (F-3): whatever the dead owner had in flight
is fenced off, and this gateway's streams start their stage-internal append counters afresh without colliding
with the dead owner's. A response that was in flight ends cancelled with duplex.reason `owner_gateway_lost`
(its output after the last event the dead owner wrote through is lost); its model turn is closed (F-5). Audio
the dead owner had not yet sent to the runtime is lost too (the client's input past the last acknowledged unit).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from gateway.admission import SlotState
from gateway.directory.replica import parse_entry
from gateway.directory.store import Entry
from gateway.directory.sweep import ORPHAN_EPOCH, close_orphan
from gateway.protocol.errors import Effect, ProtocolError
from gateway.protocol.profiles import Profile
from gateway.resume.attachment import AttachState
from gateway.resume.credentials import ResumeCredential
from gateway.runtime.base import Fence, RuntimeFailure, SessionKey
from gateway.session import snapshot
from gateway.session.core import SessionLimits
from gateway.session.runtime_config import RuntimeDefaults
from gateway.session.session import DuplexSession
from gateway.session.units import UnitGeometry

if TYPE_CHECKING:
    from gateway.directory.replica import AdoptableHost
    from gateway.state import GatewayState

ORPHAN_REASON = "owner_gateway_lost"  # duplex.reason of the response in flight when the owner died
EPOCH_PROBES = 4  # the dead owner may have moved the runtime's epoch past its last write: try the next ones

log = logging.getLogger(__name__)


class Gone(Exception):
    """The session cannot go on (its record or sequence is gone): the resume gets `session_resume_expired`."""


def _retry(message: str) -> ProtocolError:
    return ProtocolError("runtime_resume_failed", message, effect=Effect.HANDSHAKE)


async def adopt(gw: GatewayState, entry: Entry, token: object) -> None:
    """Take `entry` (its owner's lease is gone) over and host it here, detached; raises `runtime_resume_failed`
    (retryable) when it cannot now. A session that cannot go on is closed and forgotten, so the resume that
    follows answers `session_resume_expired`. `token` (the resume's) must match the copy's credential first: a
    resume that only knows the session id must not move the session and cancel its response."""
    directory, sid = gw.directory, entry.session_id
    assert directory is not None and gw.host_factory is not None
    try:
        state_raw = await directory.state(sid)
        if state_raw is not None and not _token_matches(json.loads(state_raw), token):
            raise ProtocolError("invalid_resume_token", "resume token does not match", effect=Effect.HANDSHAKE)
        won = await directory.take_over(sid, entry.owner)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - Redis away: the client retries (CL-3)
        raise _retry(f"session directory: {exc.__class__.__name__}") from exc
    if not won:
        raise _retry("another gateway is taking the session over")
    try:
        await _rebuild(gw, entry)
    except Gone as exc:
        log.warning("adopting %s of dead gateway %s: %s; closing it", sid, entry.owner, exc)
        await _forget(gw, entry)
    except ProtocolError:
        await _give_back(gw, entry)
        raise
    except Exception as exc:  # noqa: BLE001 - give it back: another try (or the sweep, after the grace) takes it
        log.warning("adopting %s of dead gateway %s failed: %s", sid, entry.owner, exc)
        await _give_back(gw, entry)
        raise _retry(f"adoption failed: {exc.__class__.__name__}") from exc
    log.info("adopted session %s of dead gateway %s (replica %s)", sid, entry.owner, entry.replica)


def _token_matches(state: dict[str, Any], token: object) -> bool:
    """The resume check RS3 against the copy's digests; a copy without them is left to `_rebuild` (Gone)."""
    host = state.get("host") if isinstance(state, dict) else None
    if not isinstance(host, dict) or not isinstance(host.get("digest"), str):
        return True
    previous = host.get("previous")
    credential = ResumeCredential(bytes.fromhex(host["digest"]), bytes.fromhex(previous) if previous else None)
    return credential.verify(token)


async def _rebuild(gw: GatewayState, entry: Entry) -> None:
    directory, sid = gw.directory, entry.session_id
    assert directory is not None and gw.host_factory is not None
    record, journal_raw, state_raw, config_raw = await directory.load(sid)
    if not record or state_raw is None or config_raw is None:
        raise Gone("nothing was written through for it")
    state = json.loads(state_raw)
    host_raw, config = state["host"], snapshot.config_from_json(json.loads(config_raw))
    if not host_raw["resumable"]:
        raise Gone("it is not resumable (journal overflow)")
    gw.admission.reserve(sid)  # AD-1 (resource_exhausted: full here, the client retries elsewhere)
    try:
        gw.registry.adopt(sid, entry.incarnation)
        try:
            host = gw.host_factory(host_raw["route"], host_raw["profile"])
            session = _session(gw, entry, config, host)
            snapshot.restore(session, state["session"])
            _restore_host(host, host_raw, record, journal_raw)
            await _reattach(gw, entry, session, state["session"]["epoch"])
        except BaseException:
            gw.registry.release(sid)
            raise
    except BaseException:
        gw.admission.rollback(sid)
        raise
    session.lane.start()
    gw.leases.add(sid)
    gw.leases.set_idle_ttl(sid, session.config.idle_timeout_s)
    gw.leases.detach(sid)  # the grace timer runs until the resume attaches (§6.2)
    gw.admission.set_state(sid, SlotState.DETACHED)
    host.start_adopted(session)


def _session(gw: GatewayState, entry: Entry, config: Any, host: AdoptableHost) -> DuplexSession:
    s = gw.settings
    limits = SessionLimits(max_pending_input_bytes=s.max_pending_input_bytes_per_session,
                           max_pending_turns=s.max_pending_turns_per_session, runtime_timeout_s=s.runtime_timeout_s,
                           close_ack_timeout_s=s.close_ack_timeout_s, idle_ttl_s=s.idle_ttl_s)
    return DuplexSession(session_id=entry.session_id, incarnation=entry.incarnation, config=config,
                         ctx=gw.config_context(Profile(host.profile)), limits=limits, runtime=gw.runtime,
                         key=SessionKey(entry.session_id, entry.correlation_id), outbox=host.outbox,
                         post_lane=host.post_lane, clock=time.monotonic,
                         geometry=UnitGeometry(deadline_grace_s=s.unit_deadline_grace_s,
                                               align_period_s=s.unit_align_s,
                                               align_min_sessions=s.unit_align_min_sessions,
                                               live_sessions=gw.admission.live),
                         runtime_defaults=RuntimeDefaults(), capabilities=gw.capabilities, limits_json=s.limits_json())


def _restore_host(host: AdoptableHost, raw: dict[str, Any], record: dict[str, str], journal: dict[str, str]) -> None:
    now = time.time()
    host.journal.restore(((int(seq), *parse_entry(v, now)) for seq, v in journal.items()),
                         last_seq=int(record.get("journal_last_seq", "0")),
                         acked_seq=int(record.get("journal_acked_seq", "0")),
                         aged_out_seq=int(record.get("journal_aged_seq", "0")))
    previous = raw["previous"]
    host.credential = ResumeCredential(bytes.fromhex(raw["digest"]),
                                       bytes.fromhex(previous) if previous is not None else None)
    att = host.attachments
    att.generation, att.resumable, att.created_delivered = raw["generation"], True, True
    att.state = AttachState.DETACHED


async def _reattach(gw: GatewayState, entry: Entry, session: DuplexSession, epoch: int) -> None:
    """Bind the session's sequence on its replica to this gateway, and fence off the dead owner's work with a
    cancel to a new epoch (module doc)."""
    reattach = getattr(gw.runtime, "reattach", None)
    if reattach is None:
        raise Gone("this gateway's runtime cannot take a session over")
    try:
        await reattach(session.key, entry.replica)
    except RuntimeFailure as exc:
        raise Gone(f"replica {entry.replica}: {exc}") from exc
    inc = entry.incarnation
    try:
        for e in range(epoch, epoch + EPOCH_PROBES):
            try:
                await gw.runtime.cancel(session.key, Fence(inc, e), Fence(inc, e + 1))
            except RuntimeFailure as exc:
                if exc.code == "stale_fence":
                    continue  # the dead owner got further than it wrote: the runtime is past `e`
                raise
            session.responses.cancel_orphan(ORPHAN_REASON, e + 1)
            return
        raise Gone(f"no cancel from epoch {epoch} to {epoch + EPOCH_PROBES} was accepted")
    except BaseException as exc:
        # unbind it again; the close also ends the sequence and forgets the record (DirectoryRuntime.close)
        try:
            await gw.runtime.close(session.key, Fence(inc, ORPHAN_EPOCH))
        except Exception as close_exc:  # noqa: BLE001 - the replica died too: nothing is held there
            log.info("could not close %s after a failed takeover: %s", entry.session_id, close_exc)
        raise Gone(f"its sequence cannot go on: {exc}") from exc


async def _give_back(gw: GatewayState, entry: Entry) -> None:
    """Hand the record back to the dead owner, so another try or, after the grace, the sweep takes it."""
    directory = gw.directory
    assert directory is not None
    try:
        await directory.give_back(entry.session_id, entry.owner)
    except Exception as exc:  # noqa: BLE001 - the record names this gateway: its close is ours now
        log.warning("could not hand %s back: %s", entry.session_id, exc)


async def _forget(gw: GatewayState, entry: Entry) -> None:
    directory = gw.directory
    assert directory is not None
    try:
        await close_orphan(entry, batch_dim=gw.settings.triton_batch_dim)
    except Exception as exc:  # noqa: BLE001 - the replica died too: nothing is held there
        log.info("could not close %s on %s: %s", entry.session_id, entry.replica, exc)
    try:
        await directory.unregister(entry.session_id)
    except Exception as exc:  # noqa: BLE001 - a stale record names this live gateway: a resume answers expired
        log.warning("could not forget %s: %s", entry.session_id, exc)
