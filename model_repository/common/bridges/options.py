"""CONFIG (the session's runtime config, gateway/session/runtime_config.py) -> engine arguments.

Every stage of a session gets the same CONFIG on open and update, so every stage checks the whole key set
(`check_config`) and then applies its own keys. A key not listed below, or a listed key with a value its stage
cannot apply, is `invalid_runtime_config`: nothing is accepted and then ignored (issue 17).

| key | stage | effect |
| --- | --- | --- |
| `instructions` | stage0 | system prompt of the prefix |
| `voice` | stage0, token2wav | the voice pack: its reference clip for the prefix, its prompt for Token2Wav |
| `ref_audio` | stage0, token2wav | base64 PCM16 16 kHz mono client clip, replacing the voice's clip in the prefix and, where the checkpoint ships the S3 tokenizer and CAM++, the vocoder's voice prompt (token2wav_bridge.py) |
| `initial_user_text` | — | null only (no user text turn in the prefix) |
| `text_only` | stage0 | no `tts_input`: the talker and the vocoder never run |
| `seed` | all | the session's generators (model.md §3.5.4); absent or null: a fresh random seed |
| `temperature` … `repetition_penalty`, `thinker.*` sampling | stage0 | `SamplingParams` (nested wins) |
| `force_listen_count` | stage0 | the first N units listen; an update restarts the count |
| `thinker.max_tokens_per_unit` | stage0 | decode steps per unit (decision + text + terminator), ≤ the engine's |
| `thinker.max_speak_chars_per_unit` | stage0 | character cap per unit (0 = off) |
| `talker.temperature` / `repetition_penalty` | tts | the session's talker sampling, per row of the batch (> 0) |
| `talker.codes_per_unit` | tts | must equal the codes a unit returns (model.md §5.3) |

Temperature is the public range [0, 2]; 0 means greedy. The gateway checked it already (gateway/protocol/validate.py),
but a stage is a trust boundary of its own: Triton's gRPC port takes other clients than the gateway, so every value
here is checked again and refused as `invalid_runtime_config` (protocol.md §2.5). The ranges are the
gateway's; tests/triton/test_runtime_options.py keeps the two equal (this package imports nothing of the gateway). An `append` may carry CONFIG too: only
`{"thinker": {"temperature": t}}` (or top-level `temperature`), the response-scoped temperature of that one
unit (protocol.md §2.8, `unit_temperature`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import secrets
from typing import Any

import numpy as np
import torch

from engine.stage0 import DecodeRules, SamplingParams

from ..codec import RequestError

TOP_KEYS = frozenset({"instructions", "voice", "ref_audio", "initial_user_text", "text_only", "temperature",
                      "top_p", "top_k", "repetition_penalty", "force_listen_count", "seed", "thinker", "talker"})
# CONFIG key -> SamplingParams field, with the type the value must convert to (top level or under "thinker").
_SAMPLING_KEYS = {"temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
                  "repetition_penalty": ("repetition_penalty", float),
                  "repetition_window": ("repetition_window", int),
                  "turn_eos_length_penalty": ("turn_eos_length_penalty", float), "seed": ("seed", int),
                  "greedy": ("greedy", bool)}
_RULE_KEYS = {"max_tokens_per_unit": "max_steps", "max_speak_chars_per_unit": "max_speak_chars_per_unit"}
THINKER_KEYS = frozenset({*_SAMPLING_KEYS, *_RULE_KEYS})
TALKER_KEYS = frozenset({"temperature", "repetition_penalty", "codes_per_unit"})
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0  # protocol.md §2.2: the public `temperature` range is [0, 2]
MAX_SEED = 2**63 - 1
PCM16_SCALE = 32768.0
_APPEND_KEYS = frozenset({"temperature"})  # what an append's CONFIG may set, top level or under "thinker"


def _bad(message: str) -> RequestError:
    return RequestError("invalid_runtime_config", message)


def _convert(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise _bad(f"CONFIG {key}={value!r} must be a number")
    if kind is bool and not isinstance(value, bool):
        raise _bad(f"CONFIG {key}={value!r} must be a boolean")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise _bad(f"CONFIG {key}={value!r} is not a {kind.__name__}") from exc


def _temperature(value: Any) -> float:
    t = _convert("temperature", value, float)
    if not math.isfinite(t) or not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise _bad(f"CONFIG temperature={value!r} is not in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    return t


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    section = config.get(name) or {}
    if not isinstance(section, dict):
        raise _bad(f"CONFIG {name} must be an object")
    return section


def check_config(config: dict[str, Any]) -> None:
    """Every key of an open/update CONFIG is one some stage applies (the table above)."""
    unknown = sorted({*(set(config) - TOP_KEYS), *(f"thinker.{k}" for k in set(_section(config, "thinker")) - THINKER_KEYS),
                      *(f"talker.{k}" for k in set(_section(config, "talker")) - TALKER_KEYS)})
    if unknown:
        raise _bad(f"CONFIG keys {unknown} are not runtime options of this server")
    if config.get("initial_user_text") is not None:
        raise _bad("CONFIG initial_user_text: this runtime feeds no user text turn into the prefix")


def seed_of(config: dict[str, Any]) -> int:
    """The session's seed: CONFIG `seed`, or a fresh random one (sessions without a seed differ)."""
    value = config.get("seed")
    if value is None:
        return secrets.randbelow(MAX_SEED + 1)
    seed = _convert("seed", value, int)
    if not 0 <= seed <= MAX_SEED:
        raise _bad(f"CONFIG seed={value!r} is not in [0, 2^63)")
    return seed


def sampling_params(config: dict[str, Any], seed: int | None = None) -> SamplingParams:
    """Thinker sampling from CONFIG; keys that are absent or null keep the engine defaults."""
    thinker = _section(config, "thinker")
    values: dict[str, Any] = {}
    for source in (config, thinker):
        for key, (name, kind) in _SAMPLING_KEYS.items():
            value = source.get(key)
            if value is not None:
                values[name] = _temperature(value) if key == "temperature" else _convert(key, value, kind)
    if seed is not None:
        values["seed"] = seed
    if values.get("temperature") == 0.0:  # the sampler divides by T: T = 0 is its limit, the argmax
        del values["temperature"]
        values["greedy"] = True
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise _bad(str(exc)) from exc


def decode_rules(config: dict[str, Any], base: DecodeRules) -> DecodeRules:
    """`thinker.max_tokens_per_unit` / `max_speak_chars_per_unit` over `base` (the engine checks the range)."""
    thinker = _section(config, "thinker")
    values = {name: _convert(key, thinker[key], int) for key, name in _RULE_KEYS.items() if thinker.get(key) is not None}
    return dataclasses.replace(base, **values)


def force_listen_count(config: dict[str, Any]) -> int | None:
    flc = config.get("force_listen_count")
    return None if flc is None else max(0, _convert("force_listen_count", flc, int))


def ref_audio(config: dict[str, Any]) -> torch.Tensor | None:
    """CONFIG `ref_audio` (base64 of 16 kHz mono PCM16, decoded by the gateway) -> fp32 [N] in [-1, 1]."""
    value = config.get("ref_audio")
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None or len(raw) % 2:
        raise _bad("CONFIG ref_audio must be base64 of 16 kHz mono PCM16")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.float32) / PCM16_SCALE)


def instructions(config: dict[str, Any]) -> str | None:
    prompt = config.get("instructions")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad("CONFIG instructions must be a string")
    return prompt


def text_only(config: dict[str, Any]) -> bool | None:
    value = config.get("text_only")
    return None if value is None else _convert("text_only", value, bool)


def unit_temperature(config: dict[str, Any]) -> float | None:
    """An append's CONFIG -> the unit's temperature override (0 = greedy), or None for the session's."""
    thinker = _section(config, "thinker")
    unknown = sorted({*(set(config) - _APPEND_KEYS - {"thinker"}),
                      *(f"thinker.{k}" for k in set(thinker) - _APPEND_KEYS)})
    if unknown:
        raise _bad(f"an append's CONFIG may only set thinker.temperature, not {unknown}")
    value = thinker.get("temperature")
    value = config.get("temperature") if value is None else value  # nested wins, null = absent (as on open)
    return None if value is None else _temperature(value)


def talker_sampling(config: dict[str, Any], *, codes_per_unit: int) -> dict[str, float]:
    """`talker.temperature` / `repetition_penalty` as TTSEngine keyword arguments (the engine checks > 0);
    `talker.codes_per_unit` must be what a unit returns (model.md §5.3 fixes it)."""
    talker = _section(config, "talker")
    codes = talker.get("codes_per_unit")
    if codes is not None and _convert("talker.codes_per_unit", codes, int) != codes_per_unit:
        raise _bad(f"CONFIG talker.codes_per_unit={codes!r}: a unit returns {codes_per_unit} codes")
    return {key: _convert(f"talker.{key}", talker[key], float) for key in ("temperature", "repetition_penalty")
            if talker.get(key) is not None}


def voice_of(config: dict[str, Any], voices: dict[str, Any], default: str) -> str:
    voice = config.get("voice") or default
    if voice not in voices:
        raise _bad(f"CONFIG voice {voice!r} is not one of {sorted(voices)}")
    return str(voice)
