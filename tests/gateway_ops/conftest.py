from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

OPS_TEST_TIMEOUT_S = 30  # unit tests of small modules: fail fast instead of hanging
SPEECH_RATE_HZ = 16000
SENTENCE = "Hello there, could you please tell me about the weather tomorrow?"


class FakeClock:
    """An injectable monotonic clock that only moves when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "gateway_ops" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(OPS_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """[n] float32 at 16 kHz: espeak-ng's synthetic voice, resampled with soxr."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    wav = Path(tmp_path_factory.mktemp("vad")) / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), SENTENCE], check=True, capture_output=True)
    x, rate = sf.read(wav, dtype="float32")
    return soxr.resample(x, rate, SPEECH_RATE_HZ).astype(np.float32)
