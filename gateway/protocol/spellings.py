"""Accepted spellings of session configuration (protocol.md §2.3-§2.5).

`extract_patch` turns one `session` object (beta, GA or native spelling) into a flat patch keyed
by canonical field name. It validates nothing but spelling conflicts and server-owned keys;
`gateway.protocol.config` validates the values.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.errors import ProtocolError

SERVER_OWNED_KEYS: frozenset[str] = frozenset({
    "duplex_stage_sampling_params", "duplex_stage_max_tokens", "duplex_stage0_max_tokens",
    "duplex_scheduler_token_id", "duplex_first_append_context_tokens", "ref_audio_data", "ref_audio_format",
    "ref_audio_sample_rate_hz", "initial_user_text", "runtime_config",
    "top_p", "top_k", "repetition_penalty", "stop", "stop_token_ids", "min_tokens",
    "listen_prob_scale", "listen_top_k", "max_new_speak_tokens_per_chunk", "tts_temperature", "tts_top_p",
    "tts_top_k", "tts_repetition_penalty",
    "idle_ttl_s", "disconnect_grace_s", "reaper_interval_s", "resume_replay_ttl_s",
    "resume_replay_max_bytes_per_session", "max_pending_input_bytes_per_session",
    "max_pending_turns_per_session", "max_sessions", "completed_append_cache_size", "handshake_timeout_s",
    "close_ack_timeout_s", "session_tombstone_ttl_s",
})
PATH_KEYS: frozenset[str] = frozenset({"ref_audio_path", "tts_ref_audio_path"})

# Plain top-level spellings: wire name -> canonical name.
_TOP: dict[str, str] = {
    "type": "type", "model": "model", "id": "id", "session_id": "id",
    "output_modalities": "output_modalities", "modalities": "output_modalities",
    "instructions": "instructions", "voice": "voice", "ref_audio": "ref_audio",
    "input_audio_format": "input_audio_format", "input_audio_sample_rate_hz": "input_audio_sample_rate_hz",
    "sample_rate_hz": "input_audio_sample_rate_hz", "output_audio_format": "output_audio_format",
    "response_format": "output_audio_format", "temperature": "temperature", "max_tokens": "max_tokens",
    "max_output_tokens": "max_output_tokens", "max_response_output_tokens": "max_output_tokens",
    "speed": "speed", "idle_timeout_s": "idle_timeout_s", "turn_detection": "turn_detection",
    "input_audio_transcription": "input_audio_transcription",
    "input_audio_noise_reduction": "input_audio_noise_reduction", "tools": "tools", "tool_choice": "tool_choice",
    "tracing": "tracing",
}
# Duplex options that live in extra_body but may also sit at the top level (§2.4).
EXTRA_KEYS: tuple[str, ...] = (
    "auto_response", "force_listen_count", "duplex_initial_user_text", "return_stage_metrics",
    "overlap_policy", "overlap_short_ack_ms", "overlap_barge_in_ms", "overlap_silence_rms",
    "playback_commit_policy", "native_duplex", "minicpmo45_native_duplex", "seed",
)
_EXTRA_ALIASES = {"tts_ref_audio": "ref_audio"}
GA_INPUT_TYPES = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
MISSING = object()


class _Patch:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def put(self, canonical: str, value: Any, spelling: str) -> None:
        if canonical in self.values and self.values[canonical] != value:
            raise ProtocolError("bad_event", f"conflicting spellings for {canonical}", param=spelling)
        self.values[canonical] = value


def check_server_owned(session: dict[str, Any]) -> None:
    extra = session.get("extra_body")
    places = [("session", session)] + ([("session.extra_body", extra)] if isinstance(extra, dict) else [])
    for where, obj in places:
        for key in obj:
            if key in PATH_KEYS:
                raise ProtocolError("unsupported_ref_audio_path", "reference audio paths are not accepted",
                                    param=f"{where}.{key}")
            if key in SERVER_OWNED_KEYS:
                raise ProtocolError("server_owned_config_key", f"{key} is server-owned", param=key)


def _ga_audio(audio: Any, patch: _Patch) -> None:
    if not isinstance(audio, dict):
        raise ProtocolError("bad_event", "audio must be an object", param="session.audio")
    inp, out = audio.get("input") or {}, audio.get("output") or {}
    if not isinstance(inp, dict) or not isinstance(out, dict):
        raise ProtocolError("bad_event", "audio.input/output must be objects", param="session.audio")
    fmt = inp.get("format")
    if isinstance(fmt, dict):
        if "type" in fmt:
            patch.put("input_audio_format", GA_INPUT_TYPES.get(fmt["type"], fmt["type"]),
                      "session.audio.input.format.type")
        if "rate" in fmt:
            patch.put("input_audio_sample_rate_hz", fmt["rate"], "session.audio.input.format.rate")
    for key, canonical in (("sample_rate_hz", "input_audio_sample_rate_hz"), ("turn_detection", "turn_detection"),
                           ("transcription", "input_audio_transcription"),
                           ("noise_reduction", "input_audio_noise_reduction")):
        if key in inp:
            patch.put(canonical, inp[key], f"session.audio.input.{key}")
    ofmt = out.get("format")
    if isinstance(ofmt, dict) and "type" in ofmt:
        patch.put("output_audio_format", ("ga", ofmt["type"], ofmt.get("rate")), "session.audio.output.format")
    if "voice" in out:
        voice = out["voice"]
        patch.put("voice", voice.get("id") if isinstance(voice, dict) else voice, "session.audio.output.voice")
    if "speed" in out:
        patch.put("speed", out["speed"], "session.audio.output.speed")


def extract_patch(session: dict[str, Any]) -> dict[str, Any]:
    """Flat canonical patch of one `session` object; raises on conflicts and server-owned keys."""
    check_server_owned(session)
    patch = _Patch()
    for key, canonical in _TOP.items():
        if key in session:
            patch.put(canonical, session[key], f"session.{key}")
    if "audio" in session:
        _ga_audio(session["audio"], patch)
    extra = session.get("extra_body", {})
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ProtocolError("bad_event", "extra_body must be an object", param="session.extra_body")
    for key in EXTRA_KEYS:
        if key in session:
            patch.put(key, session[key], f"session.{key}")
        if key in extra:
            patch.put(key, extra[key], f"session.extra_body.{key}")
    for key in ("ref_audio", "tts_ref_audio"):
        if key in extra:
            patch.put(_EXTRA_ALIASES.get(key, key), extra[key], f"session.extra_body.{key}")
    return patch.values
