"""Speech fixtures: espeak-ng sentences made with sox into 16 kHz mono PCM16, cached on disk.

Made at run time (nothing binary is committed) and cached by the hash of (sentence, rate), so a sweep and
every later run reuse the same files. A user session cycles through the sentences by its index.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

INPUT_RATE = 16_000
# short turns (about 1 s each): a user of a scripted plan must fit one, plus the VAD's silence, into the
# plan's listen units (bench/loadgen/user.py)
SENTENCES = ("Hello there.", "What time is it?", "Tell me a joke.", "How are you today?")
CACHE_ENV = "DUPLEX_LOADGEN_CACHE"


class FixtureError(RuntimeError):
    """espeak-ng or sox is missing or failed."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                       os.path.expanduser("~/.cache"), "duplex", "loadgen")
    return Path(root)


def _make(sentence: str, out: Path) -> None:
    for tool in ("espeak-ng", "sox"):
        if shutil.which(tool) is None:
            raise FixtureError(f"{tool} is not installed (apt-get install espeak-ng sox)")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "espeak.wav"
        subprocess.run(["espeak-ng", "-w", str(raw), sentence], check=True, capture_output=True)
        part = out.with_suffix(".part.wav")
        subprocess.run(["sox", str(raw), "-r", str(INPUT_RATE), "-c", "1", "-b", "16", "-e", "signed-integer",
                        str(part)], check=True, capture_output=True)
        part.replace(out)  # atomic: concurrent runs never read a half-written file


def _read(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        if w.getframerate() != INPUT_RATE or w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise FixtureError(f"{path}: expected 16 kHz mono PCM16")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy()


def speech_fixture(sentence: str, directory: Path | None = None) -> np.ndarray:
    """[n] int16 at 16 kHz: the sentence spoken by espeak-ng (made once, then read from the cache)."""
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(f"{sentence}|{INPUT_RATE}".encode()).hexdigest()[:16]
    path = directory / f"speech-{key}.wav"
    if not path.exists():
        try:
            _make(sentence, path)
        except subprocess.CalledProcessError as exc:
            raise FixtureError(f"making the speech fixture failed: {exc.stderr.decode(errors='replace')}") from exc
    return _read(path)


def speech_fixtures(directory: Path | None = None) -> list[np.ndarray]:
    return [speech_fixture(s, directory) for s in SENTENCES]
