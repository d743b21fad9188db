"""CONFIG (the session's runtime config, gateway/session/runtime_config.py) -> engine arguments.

Top-level keys are the gateway's: instructions, voice, temperature, top_p, top_k, repetition_penalty,
force_listen_count, and the nested "thinker" object (which wins over the top level); `seed` is optional
(clients and tests fix it for reproducible sessions). A value of the wrong type or out of range is
`invalid_runtime_config`, never an internal error. Temperature is the public range [0, 2]; 0 means greedy.

An `append` may carry CONFIG too: only `{"thinker": {"temperature": t}}` (or top-level `temperature`), the
response-scoped temperature of that one unit (protocol.md §2.8, `unit_temperature`).
"""

from __future__ import annotations

import math
from typing import Any

from engine.stage0 import SamplingParams

from ..codec import RequestError

# CONFIG key -> SamplingParams field, with the type the value must convert to.
_THINKER_KEYS = {"temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
                 "repetition_penalty": ("repetition_penalty", float),
                 "repetition_window": ("repetition_window", int),
                 "turn_eos_length_penalty": ("turn_eos_length_penalty", float), "seed": ("seed", int),
                 "greedy": ("greedy", bool)}
DEFAULT_SEED = 0
MAX_TEMPERATURE = 2.0  # protocol.md §2.2: the public `temperature` range is [0, 2]
_APPEND_KEYS = frozenset({"temperature"})  # what an append's CONFIG may set, top level or under "thinker"


def _bad(message: str) -> RequestError:
    return RequestError("invalid_runtime_config", message)


def _convert(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise _bad(f"CONFIG {key}={value!r} must be a number")
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise _bad(f"CONFIG {key}={value!r} is not a {kind.__name__}") from exc


def _temperature(value: Any) -> float:
    t = _convert("temperature", value, float)
    if not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
        raise _bad(f"CONFIG temperature={value!r} is not in [0, {MAX_TEMPERATURE}]")
    return t


def _thinker(config: dict[str, Any]) -> dict[str, Any]:
    thinker = config.get("thinker") or {}
    if not isinstance(thinker, dict):
        raise _bad("CONFIG thinker must be an object")
    return thinker


def seed_of(config: dict[str, Any]) -> int:
    value = config.get("seed")
    return DEFAULT_SEED if value is None else _convert("seed", value, int)


def sampling_params(config: dict[str, Any]) -> SamplingParams:
    """Thinker sampling from CONFIG; keys that are absent or null keep the engine defaults."""
    thinker = _thinker(config)
    values: dict[str, Any] = {}
    for source in (config, thinker):
        for key, (name, kind) in _THINKER_KEYS.items():
            value = source.get(key)
            if value is not None:
                values[name] = _temperature(value) if key == "temperature" else _convert(key, value, kind)
    if values.get("temperature") == 0.0:  # the sampler divides by T: T = 0 is its limit, the argmax
        del values["temperature"]
        values["greedy"] = True
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise _bad(str(exc)) from exc


def unit_temperature(config: dict[str, Any]) -> float | None:
    """An append's CONFIG -> the unit's temperature override (0 = greedy), or None for the session's."""
    thinker = _thinker(config)
    unknown = sorted({*(set(config) - _APPEND_KEYS - {"thinker"}),
                      *(f"thinker.{k}" for k in set(thinker) - _APPEND_KEYS)})
    if unknown:
        raise _bad(f"an append's CONFIG may only set thinker.temperature, not {unknown}")
    value = thinker.get("temperature")
    value = config.get("temperature") if value is None else value  # nested wins, null = absent (as on open)
    return None if value is None else _temperature(value)


def stage0_open_args(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of Stage0Engine.open."""
    flc = config.get("force_listen_count")
    prompt = config.get("instructions")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad("CONFIG instructions must be a string")
    return {"prompt": prompt, "params": sampling_params(config),
            "force_listen_count": None if flc is None else max(0, _convert("force_listen_count", flc, int))}


def voice_of(config: dict[str, Any], voices: dict[str, Any], default: str) -> str:
    voice = config.get("voice") or default
    if voice not in voices:
        raise _bad(f"CONFIG voice {voice!r} is not one of {sorted(voices)}")
    return str(voice)
