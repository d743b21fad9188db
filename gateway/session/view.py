"""Read-only projections of session state: `turn_state` (§8.5) and the session object (§2.9)."""

from __future__ import annotations

from typing import Any

from gateway.protocol.config import SessionConfig

# `s` is a DuplexSession; InputMixin is its lowest layer that holds everything read here (input and response
# state). Naming that layer keeps the mixins that use these views free of an import cycle (issue 19).
from gateway.session.inputs import InputMixin

_GA_IN = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
GA_PCM_RATE = 24000


def turn_state(s: InputMixin) -> str:
    now = s.clock()
    if s._active is not None:
        return "assistant_generating"
    last = s._responses.get(s._last_audio_response) if s._last_audio_response else None
    if last is not None and last.playback is not None and last.playback.playing(now):
        return "assistant_playing"
    if s._awaiting_unit is not None:
        return "user_committed"
    if s._item_speech_started:
        return "user_speaking"
    return "idle"


def _ga_format(fmt: str, rate: int) -> dict[str, Any] | None:
    if fmt == "pcm16":
        return {"type": "audio/pcm", "rate": GA_PCM_RATE} if rate == GA_PCM_RATE else None
    return {"type": _GA_IN[fmt]} if fmt in _GA_IN else None


def config_object(c: SessionConfig) -> dict[str, Any]:
    td = c.turn_detection
    return {
        "modalities": ["text"] if c.text_only else ["text", "audio"],
        "output_modalities": list(c.output_modalities),
        "instructions": c.instructions, "voice": c.voice,
        "input_audio_format": c.input_audio_format, "output_audio_format": c.output_audio_format,
        "input_audio_sample_rate_hz": c.input_audio_sample_rate_hz,
        "input_audio_transcription": c.input_audio_transcription,
        "input_audio_noise_reduction": c.input_audio_noise_reduction, "turn_detection": td,
        "temperature": c.temperature, "max_response_output_tokens": c.max_output_tokens,
        "max_output_tokens": c.max_output_tokens, "max_tokens": c.max_tokens, "speed": c.speed,
        "tools": list(c.tools), "tool_choice": c.tool_choice, "tracing": c.tracing,
        "idle_timeout_s": c.idle_timeout_s, "overlap_policy": c.effective_overlap_policy,
        "overlap_short_ack_ms": c.overlap_short_ack_ms, "overlap_barge_in_ms": c.overlap_barge_in_ms,
        "overlap_silence_rms": c.overlap_silence_rms, "playback_commit_policy": c.playback_commit_policy,
        "audio": {
            "input": {"format": _ga_format(c.input_audio_format, c.input_audio_sample_rate_hz),
                      "sample_rate_hz": c.input_audio_sample_rate_hz, "turn_detection": td,
                      "transcription": c.input_audio_transcription,
                      "noise_reduction": c.input_audio_noise_reduction},
            "output": {"format": _ga_format(c.output_audio_format, GA_PCM_RATE) if c.output_audio_format != "wav"
                       else None, "voice": c.voice, "speed": c.speed},
        },
        "extra_body": {"auto_response": c.auto_response, "force_listen_count": c.force_listen_count,
                       "duplex_initial_user_text": c.duplex_initial_user_text,
                       "return_stage_metrics": c.return_stage_metrics, "seed": c.seed},
        # a deployment voice has no client clip to describe: null until a client clip is set (§2.9)
        "ref_audio": c.ref_audio.descriptor() if c.ref_audio else None,
    }


def session_object(s: InputMixin, capabilities: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    last = s._responses.get(s._last_audio_response) if s._last_audio_response else None
    playback = dict(response_id=last.id, **last.playback.cursors()) if last and last.playback else None
    return {"id": s.session_id, "object": "realtime.session", "type": "realtime", "model": s.config.model,
            "state": s.state, "turn_state": turn_state(s), "epoch": s.epoch, "model_turn_id": s.model_turn_id,
            "active_response_id": s._active.id if s._active else None, "open_input_item_id": s._item_id,
            "config_generation": s.config_generation, "prefix_committed": s.prefix_committed,
            **config_object(s.config), "playback": playback, "capabilities": capabilities, "limits": limits}
