"""The launcher's stop signals (SIGTERM, SIGINT) raised as `Stop` in the main thread, and held while a child
process is being created.

A stop that lands inside `subprocess.Popen` (after the fork, before Popen has returned the child) unwinds Popen:
the child runs on, and nobody holds its pid to stop it (a tritonserver outlived its launcher that way, in
tests/e2e/test_launcher.py under load). Inside `held()` the signal is noted, and raised once the child is ours.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Stop(Exception):
    """Ctrl-C or SIGTERM: stop everything and exit 0."""


_held = 0
_pending: str | None = None


def raise_stop(signum: int, _frame: object) -> None:
    """The signal handler: raise `Stop`, or note it while a child is being created."""
    global _pending
    name = signal.Signals(signum).name
    if _held:
        _pending = name
        return
    raise Stop(name)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold a stop signal until the block has finished (create a child and keep its handle inside it)."""
    global _held, _pending
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending is not None:
            name, _pending = _pending, None
            raise Stop(name)
