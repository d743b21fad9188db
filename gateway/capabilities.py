"""Capability advertisement (protocol.md §11.4); also embedded as `session.capabilities`."""

from __future__ import annotations

from typing import Any

from gateway.protocol.validate import INPUT_FORMATS, OUTPUT_RATE_HZ
from gateway.settings import GatewaySettings


def capabilities(s: GatewaySettings) -> dict[str, Any]:
    formats = sorted(set(INPUT_FORMATS.values()))
    return {
        "object": "duplex.capabilities", "model": s.model_name, "implementation_level": "model_native_duplex",
        "chunk_period_ms": 1000, "first_unit_ms": 1030,
        "event_naming": {"default": "ga", "beta": True, "native_route": "/v1/duplex"},
        "input_modes": ["append_audio_chunk"], "signal_sources": ["model_native", "client_event", "server_policy"],
        "input_audio": {"formats": formats, "default_format": "pcm16",
                        "default_sample_rate_hz": {"/v1/realtime": 24000, "/v1/duplex": 16000},
                        "sample_rate_range_hz": [8000, 48000]},
        "output_audio": {"formats": formats, "default_format": {"/v1/realtime": "pcm16", "/v1/duplex": "wav"},
                         "sample_rate_hz": OUTPUT_RATE_HZ},
        "output_modalities": ["audio", "text"],
        "voices": list(s.voices), "default_voice_available": s.default_voice_available,
        "turn_detection": ["server_vad"], "overlap_policies": ["listen_only", "barge_in_on_speech", "auto"],
        "playback_commit_policies": ["commit_all_on_done", "ack_only"],
        "video": {"max_frames_per_append": 2, "image_formats": ["jpeg", "png"],
                  "unit_boundary_ms": {"first": 1030, "period": 1000}},
        "supports_input_append": True,
        "supports_session_resume": True, "supports_session_lease": True,
        "supports_audio_truncate": True, "supports_barge_in": True, "supports_server_vad": True,
        "supports_semantic_vad": False, "supports_text_input": False, "supports_tools": False,
        "supports_speed": False, "supports_input_transcription": False,
        "supports_multi_session": s.max_sessions > 1, "session_admission_mode": "gateway_managed",
        "target_barge_in_latency_ms": None, "limits": s.limits_json(),
    }
