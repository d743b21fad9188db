"""What the engine step does when something in it raises (issue 17): it fails only the units it was running.

A session's row that cannot be built or fed fails that session's unit alone (a failed batched forward is
retried row by row); a failure after the forward fails the step's units. A failed unit is undone: the KV
length, the turn state and the repetition history go back to before the unit, and the unit ends with a
`UnitDone` carrying the error. A session whose own prefix cannot be built or fed is closed instead. So no
failure repeats step after step, and sessions that are not in the failing rows never notice.

`StepRecovery` is a part of the step scheduler (loop.py), which calls it where a step can fail.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable

import torch

from engine.stage0.config import SpecialIds
from engine.stage0.parts import SessionTable
from engine.stage0.runner import ModelRunner, Row
from engine.stage0.session import Phase, Session
from engine.stage0.types import CapacityError, Event, UnitDone, UnitMetrics


class StepRecovery:
    def __init__(self, runner: ModelRunner, table: SessionTable, ids: SpecialIds,
                 emit: Callable[[Event], None]) -> None:
        self.runner, self.table, self.ids, self.emit = runner, table, ids, emit

    def forward(self, work: list[tuple[Session, Row]]
                ) -> tuple[dict[str, torch.Tensor], list[tuple[Session, Exception]]]:
        """The batch's forward; if it raises, each row alone, so that only the rows that fail by themselves
        fail. Rows write the KV only at and past their session's cache length, which nothing reads yet."""
        try:
            out = self.runner.forward([r for _, r in work])
            return {s.session_id: h for (s, _), h in zip(work, out, strict=True)}, []
        except Exception:  # noqa: BLE001 - isolated below
            traceback.print_exc()
        hidden, failed = {}, []
        for s, row in work:
            try:
                hidden[s.session_id] = self.runner.forward([row])[0]
            except Exception as exc:  # noqa: BLE001 - this session's row fails alone
                failed.append((s, exc))
        return hidden, failed

    def fail_step(self, s: Session, exc: Exception) -> None:
        """Undo what this step did to `s`: the unit in flight is dropped from the KV and ends with an
        `internal_error`; a system prefix that cannot be fed closes the session (its queued units end too)."""
        error = f"{type(exc).__name__}: {exc}"
        if s.phase is Phase.PREFIX:
            self.close_failed(s, error)
            return
        unit = s.unit
        if unit is None:
            return  # its unit finished before the failure: nothing of this session is undone
        s.cached_len = unit.start_len - len(s.pending_close)  # an owed close was not fed if the prefill failed
        s.turn = dataclasses.replace(unit.turn_before)
        s.history.truncate(unit.history_len)
        self.fail_unit(s, error, code="internal_error")
        s.check_accounting()

    def check_fits(self, s: Session, row: Row | None) -> Row | None:
        """`row`, or a `CapacityError` when it passes the KV slot (the caller fails `s` alone)."""
        if row is not None and row.start + row.length > self.runner.kv.reserved_pos:
            # NOTE: eviction keeps every row inside the slot; should that ever fail, this unit fails
            # (typed), never the batch's KV write (an IndexError past the cache, issue 18)
            raise CapacityError(f"{s.session_id}: positions {row.start}..{row.start + row.length - 1} pass "
                                f"the KV slot ({self.runner.kv.reserved_pos} positions)")
        return row

    def close_failed(self, s: Session, error: str) -> None:
        """Close a session whose own state cannot go on (its prefix): its units end with `internal_error`, its
        slot is freed, and later requests on it get `session_closed`."""
        if s.unit is not None:
            self.fail_unit(s, error, code="internal_error")
        for job in s.queue:
            self.emit(UnitDone(session_id=s.session_id, fence=job.fence, unit_index=job.index, is_listen=True,
                               terminator=self.ids.listen, rows=(), text="", end_of_turn=False, aborted=True,
                               metrics=UnitMetrics(queue_s=0.0, ttft_s=0.0, tpot_s=0.0, itl_s=(), tokens=0),
                               error=error, error_code="internal_error", forced=job.force_listen_override))
        s.queue.clear()
        self.table.remove(s)

    def fail_unit(self, s: Session, error: str, code: str = "bad_audio") -> None:
        unit = s.unit
        assert unit is not None
        forced = unit.decoder.force if unit.decoder is not None else unit.job.force_listen_override
        self.emit(UnitDone(session_id=s.session_id, fence=unit.job.fence, unit_index=unit.index, is_listen=True,
                           terminator=self.ids.listen, rows=(), text="", end_of_turn=False, aborted=True,
                           metrics=unit.metrics(), error=error, error_code=code, forced=forced))
        s.unit, s.phase = None, Phase.IDLE
