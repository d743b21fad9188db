"""Decode client audio (§9.1) to float32 mono and encode model audio (§9.3) for the wire.

G.711 and WAV go through libsndfile (soundfile); nothing here hand-rolls a codec.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass

import numpy as np
import soundfile

from gateway.protocol.errors import ProtocolError
from gateway.protocol.validate import G711_RATE, MAX_RATE_HZ, MIN_RATE_HZ, OUTPUT_RATE_HZ

_BYTES_PER_SAMPLE = {"pcm16": 2, "pcm_f32le": 4, "g711_ulaw": 1, "g711_alaw": 1}
_G711_SUBTYPE = {"g711_ulaw": "ULAW", "g711_alaw": "ALAW"}
WAV_SUBTYPES = frozenset({"PCM_16", "FLOAT"})  # §9.1: a WAV append is PCM 16-bit or float32, nothing else
PCM16_SCALE = 32768.0


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    samples: np.ndarray  # [n] float32 in [-1, 1]
    rate_hz: int
    wire_bytes: int


def b64decode(data: str, param: str = "audio") -> bytes:
    try:
        padded = data + "=" * (-len(data) % 4)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("bad_audio", "audio is not valid base64", param=param) from None


def _check_rate(rate: int, param: str) -> None:
    if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
        raise ProtocolError("bad_audio", f"sample rate {rate} outside 8000-48000", param=param)


def decode_audio(raw: bytes, fmt: str, rate_hz: int | None, *, rate_given: bool, param: str = "audio"
                 ) -> DecodedAudio:
    """Wire bytes -> float32 mono. `rate_hz` is the effective rate (append or session)."""
    if fmt == "wav":
        try:
            with soundfile.SoundFile(io.BytesIO(raw)) as wav:
                if wav.format not in ("WAV", "WAVEX") or wav.subtype not in WAV_SUBTYPES:
                    raise ProtocolError("bad_audio", f"WAV must be PCM 16-bit or float32, not {wav.format} "
                                        f"{wav.subtype}", param=param)
                data, sr = wav.read(dtype="float32", always_2d=True), wav.samplerate
        except (RuntimeError, soundfile.LibsndfileError):
            raise ProtocolError("bad_audio", "undecodable WAV", param=param) from None
        if data.shape[1] != 1:
            raise ProtocolError("bad_audio", "only mono audio is accepted", param=param)
        _check_rate(sr, "sample_rate_hz")
        if rate_given and rate_hz != sr:
            raise ProtocolError("bad_audio", "sample_rate_hz conflicts with the WAV header", param="sample_rate_hz")
        return DecodedAudio(np.clip(data[:, 0], -1.0, 1.0), sr, len(raw))
    assert rate_hz is not None
    _check_rate(rate_hz, "sample_rate_hz")
    width = _BYTES_PER_SAMPLE[fmt]
    if len(raw) % width:
        raise ProtocolError("bad_audio", f"{fmt} length must be a multiple of {width} bytes", param=param)
    if fmt in _G711_SUBTYPE:
        if rate_hz != G711_RATE:
            raise ProtocolError("bad_audio", "G.711 must be 8000 Hz", param="sample_rate_hz")
        samples = soundfile.read(io.BytesIO(raw), dtype="float32", format="RAW", subtype=_G711_SUBTYPE[fmt],
                                 samplerate=G711_RATE, channels=1)[0] if raw else np.zeros(0, np.float32)
    elif fmt == "pcm16":  # the hot path (every append): in [-1, 1) as it is, so no clip and no second array
        samples = np.frombuffer(raw, dtype="<i2").astype(np.float32)
        samples *= 1.0 / PCM16_SCALE  # a power of two: the same values as dividing
        return DecodedAudio(samples, rate_hz, len(raw))
    else:
        samples = np.nan_to_num(np.frombuffer(raw, dtype="<f4").astype(np.float32))
    return DecodedAudio(np.clip(samples, -1.0, 1.0), rate_hz, len(raw))


def rms(samples: np.ndarray) -> float:
    """Root mean square of float32 samples (one dot product: a fifth of mean(x**2)'s time per append)."""
    return math.sqrt(float(np.dot(samples, samples)) / len(samples)) if len(samples) else 0.0


def encode_output(pcm16: bytes, fmt: str) -> tuple[bytes, int]:
    """Model output (24 kHz PCM16 LE mono) -> wire bytes and their sample rate (§9.3)."""
    if fmt == "pcm16":
        return pcm16, OUTPUT_RATE_HZ
    samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / PCM16_SCALE
    if fmt == "pcm_f32le":
        return samples.astype("<f4").tobytes(), OUTPUT_RATE_HZ
    buf = io.BytesIO()
    if fmt == "wav":
        soundfile.write(buf, samples, OUTPUT_RATE_HZ, format="WAV", subtype="PCM_16")
        return buf.getvalue(), OUTPUT_RATE_HZ
    import soxr  # local: only G.711 output needs the one-shot resample

    down = soxr.resample(samples, OUTPUT_RATE_HZ, G711_RATE) if len(samples) else samples
    soundfile.write(buf, down, G711_RATE, format="RAW", subtype=_G711_SUBTYPE[fmt])
    return buf.getvalue(), G711_RATE


def pcm16_duration_ms(num_bytes: int, rate_hz: int = OUTPUT_RATE_HZ) -> int:
    return (num_bytes // 2) * 1000 // rate_hz
