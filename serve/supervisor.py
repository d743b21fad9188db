"""Keep `duplex serve`'s tritonserver running: restart it with backoff when it dies (issue 18 point 6).

While Triton is down the gateway stays up: its `/ready` answers 503 and new sessions get
`runtime_unavailable` (the gateway probes Triton itself), and sessions bound to the dead server got
`runtime_dead`. The supervisor logs why the server ended (signal or exit code and the log's last error
lines, never the model table), removes the Python backend's /dev/shm regions that a killed server cannot
remove itself, and starts a fresh server on the same ports; the gateway's gRPC channel reconnects to it.

This module imports neither torch nor `engine` (it runs in the gateway image too); it only manages processes.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.tritonserver import LaunchError, TritonServer

Say = Callable[[str], None]


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before the 1st, 2nd, ... restart
    max_failed_restarts: int = 5  # consecutive restarts that never became ready: give up (exit 1)
    stable_after_s: float = 60.0  # ready this long: the next crash starts the backoff over
    ready_timeout_s: float = 600.0
    note_shm_every_s: float = 2.0  # regions appear as instances load; note them while the server lives

    def delay(self, restarts: int) -> float:
        return self.backoff_s[min(restarts, len(self.backoff_s) - 1)]


@dataclass
class TritonSupervisor:
    server: TritonServer
    say: Say
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restarts: int = 0  # total, for the log and for tests
    _failed: int = 0  # consecutive restarts that did not reach ready
    _up_since: float = field(default_factory=time.monotonic)
    _noted_at: float = 0.0

    def check(self) -> None:
        """One supervision tick: note shm regions while alive; restart after a death. Raises LaunchError
        when the server keeps failing to come back."""
        proc = self.server.proc
        code = None if proc is None else proc.poll()
        if proc is not None and code is None:
            now = time.monotonic()
            if now - self._noted_at >= self.policy.note_shm_every_s:
                self.server.note_shm_regions()
                self._noted_at = now
            return
        self._restart(-9 if code is None else code)

    def _restart(self, code: int) -> None:
        self.say(f"[serve] {self.server.exit_cause(code)}")
        self._preserve_log()
        if time.monotonic() - self._up_since >= self.policy.stable_after_s:
            self._failed = 0
        while True:
            removed = self._clean()  # also after a failed restart: its half-started server
            delay = self.policy.delay(self._failed)
            self.say(f"[serve] removed {len(removed)} shared-memory region(s) of the dead server; "
                     f"restarting tritonserver in {delay:.0f}s (restart {self.restarts + 1})")
            time.sleep(delay)
            self.restarts += 1
            try:
                self.server.start()
                self.server.wait_ready(self.policy.ready_timeout_s, progress=self.say)
            except LaunchError as exc:
                self._failed += 1
                self.say(f"[serve] restart {self.restarts} failed: {exc}")
                if self._failed >= self.policy.max_failed_restarts:
                    raise LaunchError(f"tritonserver did not come back after {self._failed} restarts") from exc
                continue
            self._up_since = time.monotonic()
            self.say(f"[serve] tritonserver is back (restart {self.restarts}); new sessions are admitted again")
            return

    def _clean(self) -> list[str]:
        """Kill what is left of the old server's group (stubs) and unlink its regions."""
        return self.server.stop(grace_s=0.0)

    def _preserve_log(self) -> None:
        """Keep the dead server's log next to the new one (start() truncates it)."""
        log = self.server.log_path
        if log.exists():
            shutil.copyfile(log, log.with_suffix(f".crash{self.restarts + 1}.log"))
