"""Read-only projections of session state: `turn_state` (§8.5) and the session object (§2.9)."""

from __future__ import annotations

from typing import Any

from gateway.protocol.config import SessionConfig
from gateway.session.core import SessionCore
from gateway.session.inputs import InputTrack
from gateway.session.response_track import ResponseTrack

_GA_IN = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
GA_PCM_RATE = 24000


def turn_state(responses: ResponseTrack, inputs: InputTrack, now: float) -> str:
    phase = responses.phase(now)
    if phase is not None:
        return phase
    if inputs.awaiting_unit is not None:
        return "user_committed"
    if inputs.item_speech_started:
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


def session_object(core: SessionCore, responses: ResponseTrack, inputs: InputTrack, capabilities: dict[str, Any],
                   limits: dict[str, Any]) -> dict[str, Any]:
    last = responses.last_audio()
    playback = dict(response_id=last.id, **last.playback.cursors()) if last and last.playback else None
    active = responses.active
    return {"id": core.session_id, "object": "realtime.session", "type": "realtime", "model": core.config.model,
            "state": core.state, "turn_state": turn_state(responses, inputs, core.clock()), "epoch": responses.epoch,
            "model_turn_id": responses.model_turn_id, "active_response_id": active.id if active else None,
            "open_input_item_id": inputs.item_id, "config_generation": core.config_generation,
            "prefix_committed": core.prefix_committed, **config_object(core.config), "playback": playback,
            "capabilities": capabilities, "limits": limits}
