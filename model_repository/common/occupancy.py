"""A stage's admission state on Triton's Prometheus endpoint, for the gateways' replica routing (issue 20).

Two gauges, labelled by `stage`, read from the stage's own `SessionTable` (the table that refuses an open
with `runtime_backpressure` when it is full):
  duplex_stage_sessions        sessions this stage holds now
  duplex_stage_max_sessions    sessions it admits (the profile's max_sessions)
A gateway with several Triton replicas (gateway/runtime/replicas.py) routes each new session to the replica
whose stages have the most room, read from these, not guessed.

The value changes only on open, close and idle expiry, so `update` makes the IPC round trip to Triton only
then (a few per session life), from the execute thread that owns the table. Outside a Triton stub
(`pb_utils` absent: unit tests) the object does nothing.
"""

from __future__ import annotations

from typing import Any

SESSIONS = ("duplex_stage_sessions", "Sessions this stage holds now (its admission table)")
MAX_SESSIONS = ("duplex_stage_max_sessions", "Sessions this stage admits (max_sessions)")


class SessionGauge:
    def __init__(self, stage: str, max_sessions: int) -> None:
        self._families: list[Any] = []
        self._held: Any = None
        self._last: int | None = None
        try:
            import triton_python_backend_utils as pb_utils
        except ImportError:
            return
        held, cap = (pb_utils.MetricFamily(name=n, description=d, kind=pb_utils.MetricFamily.GAUGE)
                     for n, d in (SESSIONS, MAX_SESSIONS))
        self._families = [held, cap]
        self._cap = cap.Metric(labels={"stage": stage})
        self._cap.set(float(max_sessions))
        self._held = held.Metric(labels={"stage": stage})
        self.update(0)

    def update(self, held: int) -> None:
        if self._held is None or held == self._last:
            return
        self._held.set(float(held))
        self._last = held

    def release(self) -> None:
        """Drop the Metrics before their families, in finalize (see metrics.py: the stubs segfaulted otherwise)."""
        self._held = self._cap = None
        self._families.clear()
