"""Public session configuration (protocol.md §2.2-§2.6) and response options (§2.8): typed, validated.

`SessionConfig` is the validated `session_config` snapshot. `apply_patch` builds a full candidate
from the current snapshot and one `session` object; it never mutates anything, so a rejected
update leaves the session unchanged (§2.7 U2). `response_options` validates a `response.create`
`response` object into the typed `ResponseOptions` the session keeps for that one response.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import validate as v
from gateway.protocol.context import ConfigContext  # re-exported: callers build it with a config
from gateway.protocol.errors import ProtocolError
from gateway.protocol.spellings import SERVER_OWNED_KEYS, extract_patch

DEFAULT_INSTRUCTIONS = "Streaming Omni Conversation."


@dataclass(frozen=True, slots=True)
class SessionConfig:
    model: str
    id: str | None = None
    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = DEFAULT_INSTRUCTIONS
    voice: str = "default"
    ref_audio: v.RefAudio | None = None
    input_audio_format: str = "pcm16"
    input_audio_sample_rate_hz: int = 24000
    output_audio_format: str = "pcm16"
    temperature: float = 0.7
    max_tokens: int = 20
    max_output_tokens: int | str = "inf"
    speed: float = 1.0
    idle_timeout_s: float | None = None
    overlap_policy: str = "listen_only"
    overlap_short_ack_ms: int = 700
    overlap_barge_in_ms: int = 1200
    overlap_silence_rms: float = 0.003
    playback_commit_policy: str = "commit_all_on_done"
    turn_detection: dict[str, Any] | None = None
    input_audio_transcription: dict[str, Any] | None = None
    input_audio_noise_reduction: dict[str, Any] | None = None
    tools: tuple[Any, ...] = ()
    tool_choice: str = "auto"
    tracing: Any = None
    auto_response: bool = True
    force_listen_count: int = 0
    duplex_initial_user_text: str | None = None
    return_stage_metrics: bool = True
    # the session's sampling seed (§2.4): a fresh random one unless the client gives one; echoed so that a
    # run can be reproduced. Fixed at the prefix commit.
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def text_only(self) -> bool:
        return self.output_modalities == ("text",)

    @property
    def effective_auto_response(self) -> bool:
        td = self.turn_detection
        return self.auto_response and (td is None or bool(td.get("create_response", True)))

    @property
    def effective_overlap_policy(self) -> str:
        return "barge_in_on_speech" if self.turn_detection is not None else self.overlap_policy


def default_config(ctx: ConfigContext) -> SessionConfig:
    return SessionConfig(model=ctx.served_model, input_audio_sample_rate_hz=ctx.default_input_rate_hz,
                         output_audio_format=ctx.default_output_format, idle_timeout_s=ctx.idle_ttl_s,
                         force_listen_count=ctx.force_listen_count, seed=random_seed())


def random_seed() -> int:
    return secrets.randbelow(v.MAX_SEED + 1)


# Fields locked at the prefix commit (§2.6) and the error each raises when changed afterwards.
_LOCKED = {
    "instructions": "instructions_update_after_audio_unsupported",
    "voice": "voice_update_after_audio_unsupported",
    "ref_audio": "ref_audio_update_unsupported",
    "duplex_initial_user_text": "bad_event",
    "seed": "bad_event",
}


def apply_patch(current: SessionConfig, session: dict[str, Any], ctx: ConfigContext, *,
                opening: bool, prefix_committed: bool) -> tuple[SessionConfig, set[str]]:
    """Full candidate config and the set of canonical fields the patch touched."""
    raw = extract_patch(session)
    if not opening and "model" in raw and ctx.resolve_model(raw["model"]) != current.model:
        raise ProtocolError("model_update_unsupported", "model cannot change", param="session.model")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        checker = v.CHECKERS.get(name)
        values[name] = checker(value, ctx) if checker is not None else value
    if "id" in values and not opening:
        values.pop("id")
    if "seed" in values and values["seed"] is None:
        values["seed"] = current.seed if prefix_committed else random_seed()  # null: a fresh random seed
    values.pop("type", None)
    for flag in ("native_duplex", "minicpmo45_native_duplex"):
        if values.pop(flag, True) is False:
            raise ProtocolError("unsupported", "non-native duplex is not served", param=f"session.{flag}")
    if prefix_committed:
        for name, code in _LOCKED.items():
            if name in values and values[name] != getattr(current, name):
                raise ProtocolError(code, f"{name} cannot change after the prefix commit", param=f"session.{name}")
    candidate = dataclasses.replace(current, **values)
    if candidate.overlap_barge_in_ms < candidate.overlap_short_ack_ms:
        raise ProtocolError("bad_event", "overlap_barge_in_ms must be >= overlap_short_ack_ms",
                            param="session.overlap_barge_in_ms")
    if candidate.input_audio_format.startswith("g711") and "input_audio_sample_rate_hz" not in values:
        candidate = dataclasses.replace(candidate, input_audio_sample_rate_hz=v.G711_RATE)
    if candidate.input_audio_format.startswith("g711") and candidate.input_audio_sample_rate_hz != v.G711_RATE:
        raise ProtocolError("bad_event", "G.711 input must be 8000 Hz", param="session.input_audio_sample_rate_hz")
    if ctx.idle_ttl_s is not None and (candidate.idle_timeout_s or 0) > ctx.idle_ttl_s:
        candidate = dataclasses.replace(candidate, idle_timeout_s=ctx.idle_ttl_s)
    return candidate, set(values)


def check_voice_source(cfg: SessionConfig, ctx: ConfigContext) -> None:
    """`ref_audio_required` (§1.7): audio output needs a client clip or a deployment default voice."""
    if not cfg.text_only and cfg.ref_audio is None and not ctx.default_voice_available:
        raise ProtocolError("ref_audio_required", "audio output needs ref_audio on this deployment",
                            param="session.ref_audio")


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """Response-local copy of the options (§2.8); discarded with the response."""
    text_only: bool
    output_format: str
    # response.create's own thinker temperature; None = none given, the session's applies (and follows
    # session.update from the next append boundary, §2.7). Sent on the appends of the units it owns.
    temperature: float | None
    max_output_tokens: int | str
    metadata: dict[str, str] | None
    return_stage_metrics: bool


def response_defaults(cfg: SessionConfig) -> ResponseOptions:
    """The options of a response the client did not shape (model-started, or `response.create` without one)."""
    return ResponseOptions(text_only=cfg.text_only, output_format=cfg.output_audio_format,
                           temperature=None, max_output_tokens=cfg.max_output_tokens, metadata=None,
                           return_stage_metrics=cfg.return_stage_metrics)


def _unsupported(param: str, msg: str) -> ProtocolError:
    return ProtocolError("unsupported_response_option", msg, param=f"response.{param}")


def response_options(resp: dict[str, Any] | None, cfg: SessionConfig) -> ResponseOptions:
    """Validate a `response` object against the session; returns the response-local options."""
    r = resp or {}
    if not isinstance(r, dict):
        raise ProtocolError("bad_event", "response must be an object", param="response")
    base = response_defaults(cfg)
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
    # only an explicit value overrides the session's (see ResponseOptions.temperature)
    temperature = v.check_temperature(r["temperature"], "response.temperature") if "temperature" in r else None
    cap = base.max_output_tokens
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in r:
            cap = v.check_max_output(r[key], f"response.{key}")
    _check_fixed_options(r, audio, cfg)
    extra = r.get("extra_body") or {}
    stage_metrics = base.return_stage_metrics
    if isinstance(extra, dict):
        # server-owned keys are an error in session.update, but a response drops them silently (§2.5)
        extra = {k: x for k, x in extra.items() if k not in SERVER_OWNED_KEYS}
        if "return_stage_metrics" in extra:
            stage_metrics = v.check_boolean(extra["return_stage_metrics"], "response.extra_body.return_stage_metrics")
    return ResponseOptions(text_only=text_only, output_format=fmt, temperature=temperature, max_output_tokens=cap,
                           metadata=v.check_metadata(r.get("metadata")), return_stage_metrics=stage_metrics)


def _check_fixed_options(r: dict[str, Any], audio: Any, cfg: SessionConfig) -> None:
    """Options a response may give only as the session has them, or not at all (§2.8)."""
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
