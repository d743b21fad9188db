"""Loopback stand-in engines (tests/triton/loopback.py) whose stage0 warm-up blocks until the test creates
the file named by DUPLEX_TEST_WARMUP_GATE: a warm-up as slow as the test wants (test_warmup_ready.py).
Served by tests/e2e/profiles/slow_warmup.yaml; the stub inherits the launcher's environment."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model_repository.common.settings import StageSettings
from tests.triton import loopback

GATE_ENV = "DUPLEX_TEST_WARMUP_GATE"
POLL_S = 0.05


class GatedWarmUp:
    """A loopback engine plus a `warm_up` that waits for the gate file (the adapter calls it in initialize)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def warm_up(self, emit: Callable[[str], None]) -> None:
        gate = Path(os.environ[GATE_ENV])
        emit(f"warm-up 0/1: waiting for {gate}")
        while not gate.exists():
            time.sleep(POLL_S)
        emit("warm-up 1/1: gate open")


def stage0(settings: StageSettings) -> GatedWarmUp:
    return GatedWarmUp(loopback.make_engine(settings))


tts = token2wav = loopback.make_engine
