"""Client audio helpers: WAV I/O, resampling, PCM16 framing, and decoding of server audio payloads.

Everything is mono PCM16 little-endian (`np.int16` arrays or raw bytes). Wire rates: the client uploads
16 kHz (§2.3, declared per session and per append) and receives 24 kHz (§9.3).
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

INPUT_RATE = 16_000
OUTPUT_RATE = 24_000
CHUNK_MS = 200  # the reference continuous client's append period (§8.6 U-2)
PCM16_MAX = 32767
BYTES_PER_SAMPLE = {"pcm16": 2, "pcm_s16le": 2, "s16le": 2, "pcm": 2, "pcm_f32le": 4}


def to_pcm16(x: np.ndarray) -> np.ndarray:
    """Float [-1, 1] (any shape, channels last) -> mono int16; int16 passes through (mono-mixed)."""
    if x.ndim == 2:
        x = (x.astype(np.float32) / PCM16_MAX if x.dtype == np.int16 else x.astype(np.float32)).mean(axis=1)
    if x.dtype == np.int16:
        return x
    return (np.clip(x, -1.0, 1.0) * PCM16_MAX).round().astype(np.int16)


def read_wav(path: str | Path, rate: int | None = INPUT_RATE) -> tuple[np.ndarray, int]:
    """Read any soundfile-readable file as mono int16, resampled to `rate` (None keeps the file rate)."""
    data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)  # [T, C]
    pcm = to_pcm16(data)
    if rate is not None and rate != file_rate:
        return resample(pcm, file_rate, rate), rate
    return pcm, file_rate


def write_wav(path: str | Path, pcm16: bytes | np.ndarray, rate: int = OUTPUT_RATE) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = pcm16.tobytes() if isinstance(pcm16, np.ndarray) else pcm16
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data)
    return path


def resample(pcm16: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    if src_rate == dst_rate or len(pcm16) == 0:
        return pcm16
    y = soxr.resample(pcm16.astype(np.float32) / PCM16_MAX, src_rate, dst_rate, quality="HQ")
    return to_pcm16(y)


def chunk_pcm16(pcm16: np.ndarray, rate: int = INPUT_RATE, chunk_ms: int = CHUNK_MS) -> Iterator[bytes]:
    """Split into `chunk_ms` pieces (the last one may be shorter) as raw little-endian bytes."""
    step = rate * chunk_ms // 1000
    data = pcm16.astype("<i2")
    for start in range(0, len(data), step):
        yield data[start:start + step].tobytes()


def silence(ms: int, rate: int = INPUT_RATE) -> np.ndarray:
    return np.zeros(rate * ms // 1000, dtype=np.int16)


def duration_ms(pcm16: bytes, rate: int) -> float:
    return len(pcm16) / 2 / rate * 1000.0


def rms(pcm16: bytes) -> float:
    """RMS of samples scaled to [-1, 1] (the scale of `overlap_silence_rms`, §2.2)."""
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / PCM16_MAX
    return float(np.sqrt(np.mean(x * x))) if len(x) else 0.0


def decode_audio_payload(data: bytes, fmt: str, rate: int) -> tuple[bytes, int]:
    """One server audio delta's bytes -> (PCM16 LE mono bytes, rate). Handles §9.3's pcm16/f32/wav."""
    fmt = fmt.lower()
    if fmt == "wav":
        x, file_rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return to_pcm16(x).astype("<i2").tobytes(), int(file_rate)
    if fmt == "pcm_f32le":
        x = np.frombuffer(data, dtype="<f4")
        return to_pcm16(x).astype("<i2").tobytes(), rate
    if BYTES_PER_SAMPLE.get(fmt) == 2:
        if len(data) % 2:
            raise ValueError("pcm16 payload of odd length")
        return data, rate
    raise ValueError(f"unsupported output audio format {fmt!r}")
