"""Write-through of what a resume needs, from a session's owner to Redis, so that another gateway can adopt the
session when its owner dies (adopt.py, docs/deploy.md §11).

The `Replicator` is the session journal's mirror (`gateway.resume.journal.JournalMirror`) and its credential's
observer: on the writer's path it only notes each change (a dict entry, a number), and one task per session writes
what changed: the new events' exact bytes, the deletes of acknowledged or aged-out ones, the journal position in
the session's record, the session state (gateway/session/snapshot.py) and, when it changed, the config, as one
Lua script (store.WRITE: one command, atomic, and applied only while this gateway owns
the record). A write starts at most every `FLUSH_EVERY_S`, so events that arrive together go in one
round trip; what a dead owner had not written yet is lost (at most that long plus one round trip of events).
What is waiting is bounded as the journal is: an entry trimmed before its write is never written.
A write that finds the record no longer this gateway's (`Ownership`: taken over, or gone) stops the copying and
tells `on_lost` (DirectoryRuntime: the session ends here, gateway/directory/runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from gateway.directory.store import Ownership, SessionDirectory
from gateway.protocol.config import SessionConfig
from gateway.resume.attachment import Attachments
from gateway.resume.credentials import ResumeCredential
from gateway.resume.journal import Journal
from gateway.session import snapshot
from gateway.session.lane import LaneResult
from gateway.session.outbox import Outbox
from gateway.session.session import DuplexSession
from gateway.ws.messages import Message

FLUSH_EVERY_S = 0.01  # one write per session per 10 ms at most: batches bursts, bounds the Redis load
RETRY_S = 0.5  # after a failed write (Redis away): the changes stay queued and go with the next one

log = logging.getLogger(__name__)


class ReplicatedHost(Protocol):
    """What of a hosted session (`gateway.ws.live.LiveSession`) is copied, and its mailbox (ownership lost)."""
    route: str
    profile: str
    journal: Journal
    credential: ResumeCredential
    attachments: Attachments
    session: DuplexSession | None

    def post(self, msg: Message) -> None: ...


class AdoptableHost(ReplicatedHost, Protocol):
    """A new host for an adopted session (made by the app's `host_factory` for a route and profile): the session is
    built on its outbox and lane callback, then hosted, detached, with `start_adopted` (adopt.py)."""
    outbox: Outbox

    def post_lane(self, result: LaneResult) -> None: ...
    def start_adopted(self, session: DuplexSession) -> None: ...


HostFactory = Callable[[str, str], AdoptableHost]  # (route, profile) -> a new host
OnLost = Callable[[str, Ownership], None]  # (session id, MOVED or GONE)


def host_state(host: ReplicatedHost) -> dict[str, Any]:
    current, previous = host.credential.digests()
    return {"route": host.route, "profile": host.profile, "generation": host.attachments.generation,
            "resumable": host.attachments.resumable and not host.journal.overflowed, "digest": current.hex(),
            "previous": previous.hex() if previous is not None else None}


def entry_text(data: bytes, wall_s: float) -> str:
    """A journal entry as stored: "<wall ms> <exact text>" (the age decides J-3 pruning at adoption)."""
    return f"{int(wall_s * 1000)} {data.decode('utf-8')}"


def parse_entry(value: str, now_s: float) -> tuple[bytes, float]:
    """(exact bytes, age in seconds) of a stored entry."""
    wall_ms, _, text = value.partition(" ")
    return text.encode("utf-8"), max(0.0, now_s - int(wall_ms) / 1000)


class Replicator:
    def __init__(self, directory: SessionDirectory, session_id: str, host: ReplicatedHost,
                 on_lost: OnLost | None = None) -> None:
        self.directory, self.session_id, self.host, self.on_lost = directory, session_id, host, on_lost
        self._pending: dict[int, str] = {}  # seq -> stored entry, not written yet
        self._trim_upto = 0  # entries <= this are gone from the journal
        self._removed_upto = 0  # ... and from Redis (or were never written)
        self._flushed_hi = 0  # the highest seq written
        self._overflowed = False
        self._config: SessionConfig | None = None  # the config last written
        self._wake = asyncio.Event()
        self._closing = False
        self.lost = False  # the record is not this gateway's any more: nothing more is written
        self._task: asyncio.Task[None] | None = None
        self.writes = 0  # pipelines written (for tests and the bench)

    # ---- JournalMirror and the credential's observer: note, never wait --------------------------------------
    def appended(self, seq: int, data: bytes) -> None:
        self._pending[seq] = entry_text(data, time.time())
        self._wake.set()

    def trimmed(self, upto_seq: int, *, aged: bool) -> None:
        self._trim_upto = max(self._trim_upto, upto_seq)
        for seq in [s for s in self._pending if s <= upto_seq]:
            del self._pending[seq]
        self._wake.set()

    def overflowed(self) -> None:
        self._overflowed = True
        self._pending.clear()
        self._wake.set()

    def changed(self) -> None:
        self._wake.set()

    def stop_lost(self) -> None:
        """The record is another gateway's, or gone: write nothing more (the task ends at its next wake)."""
        self.lost = self._closing = True
        self._wake.set()

    # ---- the writing task ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Attach to the host's journal and credential and write the first copy at once."""
        self.host.journal.mirror = self
        self.host.credential.on_change = self.changed
        self._trim_upto = self._removed_upto = self.host.journal.acked_seq
        self._flushed_hi = self.host.journal.last_seq  # an adopted journal: its entries are in Redis already
        self._task = asyncio.create_task(self._run(), name=f"replica:{self.session_id}")
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.lost:
                return
            started = loop.time()
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: the changes wait for the next write
                log.warning("directory: write-through of %s failed: %s", self.session_id, exc)
                self._wake.set()
                await asyncio.sleep(RETRY_S)
                continue
            if self._closing:
                return
            await asyncio.sleep(max(0.0, FLUSH_EVERY_S - (loop.time() - started)))

    async def flush(self) -> None:
        """Write everything noted so far in one pipeline."""
        session = self.host.session
        if session is None:
            return
        journal = self.host.journal
        adds, self._pending = self._pending, {}
        trim_to = self._trim_upto
        deletes = [str(s) for s in range(self._removed_upto + 1, min(trim_to, self._flushed_hi) + 1)]
        state = json.dumps({"host": host_state(self.host), "session": snapshot.capture(session)},
                           separators=(",", ":"))
        config = session.config if session.config is not self._config else None
        args = ["1" if self._overflowed else "0", str(journal.last_seq), str(journal.acked_seq),
                str(journal.aged_out_seq), state,
                json.dumps(snapshot.config_json(config), separators=(",", ":")) if config is not None else "",
                str(len(adds))]
        for seq, entry in adds.items():
            args += (str(seq), entry)
        args += deletes
        try:
            owner = await self.directory.write_through(self.session_id, args)
        except BaseException:
            self._pending = {**{s: v for s, v in adds.items() if s > self._trim_upto}, **self._pending}
            raise
        if owner is not Ownership.MINE:  # taken over or swept while this gateway was cut off: stop copying
            log.warning("directory: %s is no longer this gateway's (%s), its copy is not written", self.session_id,
                        owner.name)
            self.stop_lost()
            if self.on_lost is not None:
                self.on_lost(self.session_id, owner)
            return
        self.writes += 1
        self._flushed_hi = max(self._flushed_hi, max(adds, default=0))
        self._removed_upto = max(self._removed_upto, trim_to)
        if config is not None:
            self._config = config

    async def aclose(self) -> None:
        """Stop after the write in progress (a cancel could land a write after the record's delete)."""
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            try:
                async with asyncio.timeout(2 * self.directory.lease_s):
                    await asyncio.shield(task)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.host.journal.mirror is self:
            self.host.journal.mirror = None
