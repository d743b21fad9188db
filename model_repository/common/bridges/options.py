"""CONFIG (the session's runtime config, gateway/session/runtime_config.py) -> engine arguments.

Top-level keys are the gateway's: instructions, voice, temperature, top_p, top_k, repetition_penalty,
force_listen_count, and the nested "thinker" object (which wins over the top level); `seed` is optional
(clients and tests fix it for reproducible sessions). A value of the wrong type or out of range is
`invalid_runtime_config`, never an internal error.
"""

from __future__ import annotations

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


def _bad(message: str) -> RequestError:
    return RequestError("invalid_runtime_config", message)


def _convert(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise _bad(f"CONFIG {key}={value!r} must be a number")
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise _bad(f"CONFIG {key}={value!r} is not a {kind.__name__}") from exc


def seed_of(config: dict[str, Any]) -> int:
    value = config.get("seed")
    return DEFAULT_SEED if value is None else _convert("seed", value, int)


def sampling_params(config: dict[str, Any]) -> SamplingParams:
    """Thinker sampling from CONFIG; keys that are absent or null keep the engine defaults."""
    thinker = config.get("thinker") or {}
    if not isinstance(thinker, dict):
        raise _bad("CONFIG thinker must be an object")
    values: dict[str, Any] = {}
    for source in (config, thinker):
        for key, (name, kind) in _THINKER_KEYS.items():
            if source.get(key) is not None:
                values[name] = _convert(key, source[key], kind)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise _bad(str(exc)) from exc


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
