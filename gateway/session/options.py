"""`response.create` response-scoped options (protocol.md §2.8)."""

from __future__ import annotations

from typing import Any

from gateway.protocol import validate as v
from gateway.protocol.config import SessionConfig
from gateway.protocol.errors import ProtocolError
from gateway.protocol.spellings import SERVER_OWNED_KEYS
from gateway.session.responses import ResponseOptions

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _unsupported(param: str, msg: str) -> ProtocolError:
    return ProtocolError("unsupported_response_option", msg, param=f"response.{param}")


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or any(not isinstance(k, str) or len(k) > MAX_METADATA_KEY_CHARS or not isinstance(x, str)
                   or len(x) > MAX_METADATA_VALUE_CHARS for k, x in value.items())):
        raise ProtocolError("bad_event", "metadata: at most 16 string pairs (key <= 64, value <= 512 chars)",
                            param="response.metadata")
    return dict(value)


def defaults(cfg: SessionConfig) -> ResponseOptions:
    return ResponseOptions(text_only=cfg.text_only, output_format=cfg.output_audio_format,
                           temperature=None, max_output_tokens=cfg.max_output_tokens, metadata=None,
                           return_stage_metrics=cfg.return_stage_metrics)


def parse(resp: dict[str, Any] | None, cfg: SessionConfig) -> ResponseOptions:
    """Validate a `response` object against the session; returns the response-local options."""
    r = resp or {}
    if not isinstance(r, dict):
        raise ProtocolError("bad_event", "response must be an object", param="response")
    base = defaults(cfg)
    text_only = base.text_only
    for key in ("output_modalities", "modalities"):
        if key in r:
            text_only = v.check_modalities(r[key], param=f"response.{key}") == ("text",)
    fmt = base.output_format
    audio = r.get("audio") or {}
    out_fmt = (audio.get("output") or {}).get("format") if isinstance(audio, dict) else None
    if "output_audio_format" in r:
        fmt = v.output_format(r["output_audio_format"], "response.output_audio_format")
    elif out_fmt is not None:
        fmt = v.output_format(out_fmt, "response.audio.output.format")
    temperature = None  # only an explicit value overrides the session's (see ResponseOptions.temperature)
    if "temperature" in r:
        t = r["temperature"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t <= 2.0:
            raise ProtocolError("bad_event", "temperature must be in [0, 2]", param="response.temperature")
        temperature = float(t)
    cap = base.max_output_tokens
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in r:
            val = r[key]
            if not (val == "inf" or (isinstance(val, int) and not isinstance(val, bool) and val >= 1)):
                raise ProtocolError("bad_event", f"{key} must be >= 1 or \"inf\"", param=f"response.{key}")
            cap = val
    if "instructions" in r and r["instructions"] != cfg.instructions:
        raise _unsupported("instructions", "instructions cannot change per response")
    voice = r.get("voice", (audio.get("output") or {}).get("voice") if isinstance(audio, dict) else None)
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None and voice != cfg.voice:
        raise _unsupported("voice", "voice cannot change per response")
    if r.get("conversation", "auto") != "auto":
        raise _unsupported("conversation", "only conversation:\"auto\" is supported")
    if r.get("input"):
        raise _unsupported("input", "response input items are not supported")
    if r.get("tools"):
        raise _unsupported("tools", "tools are not supported")
    if r.get("tool_choice", "auto") not in ("auto", "none"):
        raise _unsupported("tool_choice", "tool_choice must be auto or none")
    extra = r.get("extra_body") or {}
    stage_metrics = base.return_stage_metrics
    if isinstance(extra, dict):
        extra = {k: x for k, x in extra.items() if k not in SERVER_OWNED_KEYS}  # dropped silently (§2.5)
        if "return_stage_metrics" in extra:
            if not isinstance(extra["return_stage_metrics"], bool):
                raise ProtocolError("bad_event", "return_stage_metrics must be a boolean",
                                    param="response.extra_body.return_stage_metrics")
            stage_metrics = extra["return_stage_metrics"]
    return ResponseOptions(text_only=text_only, output_format=fmt, temperature=temperature, max_output_tokens=cap,
                           metadata=_metadata(r.get("metadata")), return_stage_metrics=stage_metrics)
