"""Value checks for canonical session fields and response options (protocol.md §2.2, §2.4, §2.8, §8.1, §9).

Each checker takes the raw wire value and the ConfigContext and returns the normalised value or
raises the ProtocolError the spec names for that field. This is the one place a client value is checked:
the session and the runtime below trust what comes out of here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile

from gateway.protocol.context import ConfigContext
from gateway.protocol.errors import ProtocolError

G711_RATE = 8000
MIN_RATE_HZ, MAX_RATE_HZ = 8000, 48000
OUTPUT_RATE_HZ = 24000
MAX_INSTRUCTIONS_CHARS = 32768
MAX_INITIAL_TEXT_CHARS = 8192
MAX_REF_AUDIO_BYTES = 10 * 1024 * 1024
MAX_REF_AUDIO_MS = 30_000
# The vocoder's voice prompt refuses less (engine/token2wav/prompt.py MIN_CLIP_SECONDS, SILENCE_RMS): checked here
# too, so the client gets `bad_audio` on its session.update, not a runtime failure when the stages open.
MIN_REF_AUDIO_MS = 500
MIN_REF_AUDIO_RMS = 1e-3  # -60 dBFS
MAX_TOKENS_PER_UNIT = 20
# The public thinker `temperature` range (§2.2; response-scoped too, §2.8). The Triton stage is a trust boundary of
# its own (its gRPC port takes other clients) and checks the same range again: MAX_TEMPERATURE in
# model_repository/common/bridges/options.py, kept equal by tests/triton/test_runtime_options.py.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_SEED = 2**63 - 1
REF_AUDIO_RATE_HZ = 16000  # the clip reaches the model as 16 kHz mono (model.md §2.6)
OVERLAP_MS_MAX = 10_000
MAX_VIDEO_FRAMES = 2
MAX_FRAME_BYTES = 4 * 1024 * 1024
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")
PCM16_ALIASES = {"pcm16": "pcm16", "pcm_s16le": "pcm16", "s16le": "pcm16", "pcm": "pcm16"}
INPUT_FORMATS = {**PCM16_ALIASES, "pcm_f32le": "pcm_f32le", "g711_ulaw": "g711_ulaw", "g711_alaw": "g711_alaw",
                 "wav": "wav"}
OUTPUT_FORMATS = INPUT_FORMATS
_GA_OUTPUT = {"audio/pcm": ("pcm16", OUTPUT_RATE_HZ), "audio/pcmu": ("g711_ulaw", G711_RATE),
              "audio/pcma": ("g711_alaw", G711_RATE)}
_REF_AUDIO_RE = re.compile(r"^data:audio/(wav|x-wav|mpeg|flac|ogg);base64,(.*)$", re.S)
OVERLAP_POLICIES = ("listen_only", "barge_in_on_speech", "auto")
COMMIT_POLICIES = ("commit_all_on_done", "ack_only")


@dataclass(frozen=True, slots=True)
class RefAudio:
    """A validated client voice clip; echoed as a descriptor, never as bytes (§2.9)."""
    data: bytes
    sha256: str
    duration_ms: int | None
    pcm16k: bytes = b""  # the clip decoded to 16 kHz mono PCM16 (little-endian): what the runtime gets

    def descriptor(self) -> dict[str, Any]:
        return {"source": "client", "sha256": self.sha256, "duration_ms": self.duration_ms}


def _bad(param: str, msg: str, code: str = "bad_event") -> ProtocolError:
    return ProtocolError(code, msg, param=f"session.{param}")


def _name(param: str) -> str:
    return param.split(".", 1)[-1]  # "session.turn_detection.threshold" -> "turn_detection.threshold"


def check_number(value: Any, param: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    """A number in [lo, hi] (an integer if `integer`; never a bool, NaN or infinity), else `bad_event`."""
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ProtocolError("bad_event", f"{_name(param)} must be {kind} in [{lo}, {hi}]", param=param)
    return value


def check_temperature(value: Any, param: str) -> float:
    return float(check_number(value, param, MIN_TEMPERATURE, MAX_TEMPERATURE))


def check_boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError("bad_event", f"{_name(param)} must be a boolean", param=param)
    return value


def check_max_output(value: Any, param: str) -> int | str:
    """`max_output_tokens` and its spellings: an integer >= 1 or "inf" (§2.2, §2.8)."""
    if value == "inf" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ProtocolError("bad_event", f"{_name(param)} must be an integer >= 1 or \"inf\"", param=param)


def check_metadata(value: Any, param: str = "response.metadata") -> dict[str, str] | None:
    """A response's `metadata` (§1.5): at most 16 string pairs, echoed unchanged."""
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or any(not isinstance(k, str) or len(k) > MAX_METADATA_KEY_CHARS or not isinstance(x, str)
                   or len(x) > MAX_METADATA_VALUE_CHARS for k, x in value.items())):
        raise ProtocolError("bad_event", "metadata: at most 16 string pairs (key <= 64, value <= 512 chars)",
                            param=param)
    return dict(value)


def _number(name: str, lo: float, hi: float, *, integer: bool = False) -> Callable[[Any, Any], Any]:
    def check(value: Any, ctx: Any) -> Any:
        return check_number(value, f"session.{name}", lo, hi, integer=integer)
    return check


def _boolean(name: str) -> Callable[[Any, Any], bool]:
    def check(value: Any, ctx: Any) -> bool:
        return check_boolean(value, f"session.{name}")
    return check


def _opt_object(name: str) -> Callable[[Any, Any], Any]:
    def check(value: Any, ctx: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise _bad(name, f"{name} must be an object or null")
        return value
    return check


def check_modalities(value: Any, ctx: Any = None, param: str = "session.output_modalities") -> tuple[str, ...]:
    if not isinstance(value, list) or not value or any(m not in ("text", "audio") for m in value):
        raise ProtocolError("unsupported_response_modality", "output modalities must be a non-empty subset "
                            "of text/audio", param=param)
    return ("audio",) if "audio" in value else ("text",)


def input_format(value: Any, param: str = "session.input_audio_format") -> str:
    if not isinstance(value, str) or value not in INPUT_FORMATS:
        raise ProtocolError("unsupported_audio_format", f"unsupported audio format {value!r}", param=param)
    return INPUT_FORMATS[value]


def output_format(value: Any, param: str = "session.output_audio_format") -> str:
    if isinstance(value, tuple):  # GA ("ga", type, rate) from spellings
        _, ga_type, rate = value
        if ga_type not in _GA_OUTPUT or (rate is not None and rate != _GA_OUTPUT[ga_type][1]):
            raise ProtocolError("unsupported_audio_format", "unsupported output format", param=param)
        return _GA_OUTPUT[ga_type][0]
    if isinstance(value, dict):  # response.create audio.output.format object
        return output_format(("ga", value.get("type"), value.get("rate")), param)
    if not isinstance(value, str) or value not in OUTPUT_FORMATS:
        raise ProtocolError("unsupported_audio_format", f"unsupported output format {value!r}", param=param)
    return OUTPUT_FORMATS[value]


def check_ref_audio(value: Any, ctx: Any = None) -> RefAudio | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("data:"):
        raise ProtocolError("unsupported_ref_audio_path", "ref_audio must be a data: URI",
                            param="session.ref_audio")
    m = _REF_AUDIO_RE.match(value)
    if m is None or len(m.group(2)) > MAX_REF_AUDIO_BYTES * 4 // 3 + 4:
        raise _bad("ref_audio", "ref_audio must be data:audio/<type>;base64 of at most 10 MiB", "bad_audio")
    try:
        data = base64.b64decode(m.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise _bad("ref_audio", "ref_audio is not valid base64", "bad_audio") from None
    try:
        info = soundfile.info(io.BytesIO(data))
        if info.frames * 1000 // info.samplerate > MAX_REF_AUDIO_MS:
            raise _bad("ref_audio", "ref_audio is longer than 30 s", "bad_audio")
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError):  # the runtime needs the samples: any undecodable clip
        raise _bad("ref_audio", "ref_audio could not be decoded", "bad_audio") from None
    mono = samples.mean(axis=1)
    if samples.shape[0] * 1000 // rate < MIN_REF_AUDIO_MS:
        raise _bad("ref_audio", f"ref_audio is shorter than {MIN_REF_AUDIO_MS} ms: a voice needs more", "bad_audio")
    if not np.isfinite(mono).all() or float(np.sqrt(np.mean(np.square(mono, dtype=np.float64)))) < MIN_REF_AUDIO_RMS:
        raise _bad("ref_audio", "ref_audio is silent (below -60 dBFS): it carries no voice", "bad_audio")
    pcm16k = _to_pcm16k(mono, rate)
    return RefAudio(data=data, sha256=hashlib.sha256(data).hexdigest(),
                    duration_ms=int(samples.shape[0] * 1000 // rate), pcm16k=pcm16k)


def _to_pcm16k(mono: np.ndarray, rate: int) -> bytes:
    """Mono float samples at `rate` -> 16 kHz PCM16 little-endian bytes (soxr, as the input path)."""
    import soxr  # local: only a client voice clip needs the one-shot resample

    if rate != REF_AUDIO_RATE_HZ and len(mono):
        mono = soxr.resample(mono, rate, REF_AUDIO_RATE_HZ)
    return (np.clip(mono, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def check_video_frames(frames: list[str] | None) -> tuple[bytes, ...]:
    """An append's `video_frames`: at most 2 bare-base64 JPEG/PNG images of at most 4 MiB each (§3.1.1, §9.4)."""
    if not frames:
        return ()
    if len(frames) > MAX_VIDEO_FRAMES:
        raise ProtocolError("bad_video_frames", "at most 2 frames per append", param="video_frames")
    out = []
    for i, f in enumerate(frames):
        if f.startswith("data:"):
            raise ProtocolError("bad_video_frames", "strip the data: prefix", param=f"video_frames[{i}]")
        try:
            data = base64.b64decode(f + "=" * (-len(f) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("bad_video_frames", "undecodable frame", param=f"video_frames[{i}]") from None
        if len(data) > MAX_FRAME_BYTES or not data.startswith(_IMAGE_MAGIC):
            raise ProtocolError("bad_video_frames", "frame must be a JPEG/PNG of at most 4 MiB",
                                param=f"video_frames[{i}]")
        out.append(data)
    return tuple(out)


def check_seed(value: Any, ctx: Any = None) -> int | None:
    """`seed`: an integer in [0, 2^63) for a reproducible session, or null for a fresh random one."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise _bad("seed", "seed must be an integer in [0, 2^63) or null")
    return value


def check_turn_detection(value: Any, ctx: Any = None) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("turn_detection", "turn_detection must be an object or null")
    if value.get("type") != "server_vad":
        raise ProtocolError("unsupported_turn_detection", "only server_vad is supported",
                            param="session.turn_detection.type")
    if value.get("interrupt_response", True) is not True:
        raise ProtocolError("unsupported_turn_detection", "interrupt_response:false is not supported",
                            param="session.turn_detection.interrupt_response")
    if value.get("idle_timeout_ms") is not None:
        raise ProtocolError("unsupported_turn_detection", "idle_timeout_ms is not supported",
                            param="session.turn_detection.idle_timeout_ms")
    out = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
           "interrupt_response": True, "create_response": True, "idle_timeout_ms": None}
    for key, lo, hi, integer in (("threshold", 0.0, 1.0, False), ("prefix_padding_ms", 0, 5000, True),
                                 ("silence_duration_ms", 100, 5000, True)):
        if key in value:
            out[key] = _number(f"turn_detection.{key}", lo, hi, integer=integer)(value[key], ctx)
    if "create_response" in value:
        out["create_response"] = _boolean("turn_detection.create_response")(value["create_response"], ctx)
    return out


def _model(value: Any, ctx: ConfigContext) -> str:
    if not isinstance(value, str):
        raise _bad("model", "model must be a string")
    resolved = ctx.resolve_model(value)
    if resolved is None:
        raise ProtocolError("model_not_found", f"model {value!r} is not served", param="session.model")
    return resolved


def _voice(value: Any, ctx: ConfigContext) -> str:
    if not isinstance(value, str) or value not in ctx.voices:
        raise ProtocolError("invalid_voice", f"voice {value!r} is not a deployment voice", param="session.voice")
    return value


def _text(name: str, limit: int, nullable: bool = False) -> Callable[[Any, Any], Any]:
    def check(value: Any, ctx: Any) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or len(value) > limit:
            raise _bad(name, f"{name} must be a string of at most {limit} characters")
        return value
    return check


def _enum(name: str, allowed: tuple[str, ...], coerce: str | None = None) -> Callable[[Any, Any], str]:
    def check(value: Any, ctx: Any) -> str:
        if value not in allowed:
            if coerce is not None:
                return coerce
            raise _bad(name, f"{name} must be one of {allowed}")
        return value
    return check


def _simple(pred: Callable[[Any], bool], name: str, msg: str) -> Callable[[Any, Any], Any]:
    def check(value: Any, ctx: Any) -> Any:
        if not pred(value):
            raise _bad(name, msg)
        return tuple(value) if isinstance(value, list) else value
    return check


def _rate(value: Any, ctx: Any) -> int:
    return _number("input_audio_sample_rate_hz", MIN_RATE_HZ, MAX_RATE_HZ, integer=True)(value, ctx)


CHECKERS: dict[str, Callable[[Any, Any], Any]] = {
    "type": _enum("type", ("realtime",)),
    "model": _model,
    "id": _simple(lambda x: isinstance(x, str) and re.match(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$", x) is not None,
                  "id", "invalid session id"),
    "output_modalities": check_modalities,
    "instructions": _text("instructions", MAX_INSTRUCTIONS_CHARS),
    "voice": _voice,
    "ref_audio": check_ref_audio,
    "input_audio_format": lambda value, ctx: input_format(value),
    "input_audio_sample_rate_hz": _rate,
    "output_audio_format": lambda value, ctx: output_format(value),
    "temperature": _number("temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
    "max_tokens": _number("max_tokens", 1, MAX_TOKENS_PER_UNIT, integer=True),
    "max_output_tokens": lambda value, ctx: check_max_output(value, "session.max_output_tokens"),
    "speed": _number("speed", 0.25, 4.0),
    "idle_timeout_s": _simple(lambda x: isinstance(x, int | float) and not isinstance(x, bool) and x > 0,
                              "idle_timeout_s", "idle_timeout_s must be > 0"),
    "overlap_policy": _enum("overlap_policy", OVERLAP_POLICIES, coerce="listen_only"),
    "overlap_short_ack_ms": _number("overlap_short_ack_ms", 0, OVERLAP_MS_MAX, integer=True),
    "overlap_barge_in_ms": _number("overlap_barge_in_ms", 0, OVERLAP_MS_MAX, integer=True),
    "overlap_silence_rms": _number("overlap_silence_rms", 0.0, 1.0),
    "playback_commit_policy": _enum("playback_commit_policy", COMMIT_POLICIES),
    "turn_detection": check_turn_detection,
    "input_audio_transcription": _opt_object("input_audio_transcription"),
    "input_audio_noise_reduction": _opt_object("input_audio_noise_reduction"),
    "tools": _simple(lambda x: isinstance(x, list), "tools", "tools must be an array"),
    "tool_choice": _enum("tool_choice", ("auto", "none")),
    "auto_response": _boolean("auto_response"),
    "force_listen_count": _number("force_listen_count", 0, 2**31, integer=True),
    "duplex_initial_user_text": _text("duplex_initial_user_text", MAX_INITIAL_TEXT_CHARS, nullable=True),
    "return_stage_metrics": _boolean("return_stage_metrics"),
    "seed": check_seed,
    "native_duplex": _boolean("native_duplex"),
    "minicpmo45_native_duplex": _boolean("minicpmo45_native_duplex"),
}
