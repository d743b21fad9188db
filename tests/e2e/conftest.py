"""Fixtures for the end-to-end suite: one real stack (tritonserver + gateway subprocesses) per module.

A module sets `STACK_ENV` (extra DUPLEX_* gateway settings) and `STACK_MODE` ("both" = one `duplex serve`,
"split" = `--only triton` + `--only gateway`, so a test can kill and restart Triton under the gateway).
The profile is DUPLEX_E2E_PROFILE or deploy/profiles/default.yaml; it is printed in the pytest header.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from tests.e2e.stack import Stack, profile_path

SPEECH_RATE_HZ = 16000
SENTENCE = "Hello there, could you please tell me about the weather tomorrow?"
E2E_TIMEOUT_S = 90


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any("tests/e2e" in str(getattr(r, "fspath", "")) or "tests/e2e" in getattr(r, "nodeid", "")
           for reports in terminalreporter.stats.values() for r in reports):
        terminalreporter.write_line(f"e2e profile: {profile_path()}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


@pytest.fixture(scope="session")
def e2e_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir for the session: the tiny checkpoint is generated once, each stack rebuilds its repository."""
    return tmp_path_factory.mktemp("e2e-cache")


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, e2e_cache: Path) -> Iterator[Stack]:
    mod = request.module
    s = Stack(e2e_cache, env=dict(getattr(mod, "STACK_ENV", {})), mode=getattr(mod, "STACK_MODE", "both"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def addr(stack: Stack) -> str:
    return stack.addr


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """[n] float32 at 16 kHz: espeak-ng's synthetic voice, resampled with soxr."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    wav = Path(tmp_path_factory.mktemp("speech")) / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), SENTENCE], check=True, capture_output=True)
    x, rate = sf.read(wav, dtype="float32")
    return soxr.resample(x, rate, SPEECH_RATE_HZ).astype(np.float32)

