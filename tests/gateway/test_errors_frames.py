"""Every applicable reject-frame / report code of protocol.md §1.7 is reached, and the session carries on.

Each case sends one bad frame on an open session, expects exactly the typed error (nested shape on
/v1/realtime, client event_id echoed, class and retryable per §1.7), then proves the session is unchanged
and alive with a `conversation.item.retrieve` round trip and a clean close.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import soundfile

from gateway.protocol.errors import CODES
from tests.gateway.harness import append, pcm16_b64
from tests.gateway.scenario import assert_conformant, close, session


def _wav(rate: int, channels: int = 1, ms: int = 100) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros((rate * ms // 1000, channels), np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


PNG = b"\x89PNG\r\n\x1a\n" + bytes(16)
CASES: list[tuple[str, Any, str, str | None]] = [
    # (name, frame, code, param)
    ("invalid_json", "{not json", "invalid_json", None),
    ("non_object", "[1, 2]", "invalid_json", None),
    ("missing_type", {"event_id": "e"}, "bad_event", "type"),
    ("long_event_id", {"type": "session.heartbeat", "event_id": "x" * 129}, "bad_event", "event_id"),
    ("ill_typed_field", {"type": "input_audio_buffer.append", "audio": 5}, "bad_event", "audio"),
    ("unknown_event", {"type": "response.explode"}, "unknown_event", "type"),
    ("odd_pcm16", {"type": "input_audio_buffer.append", "audio": _b64(b"\x00\x01\x02")}, "bad_audio", "audio"),
    ("bad_base64", {"type": "input_audio_buffer.append", "audio": "%%%"}, "bad_audio", "audio"),
    ("rate_out_of_range", append(100, sample_rate_hz=7000), "bad_audio", "sample_rate_hz"),
    ("stereo_wav", {"type": "input_audio_buffer.append", "audio": _b64(_wav(16000, 2)), "format": "wav"},
     "bad_audio", "audio"),
    ("wav_rate_conflict", {"type": "input_audio_buffer.append", "audio": _b64(_wav(16000)), "format": "wav",
                           "sample_rate_hz": 24000}, "bad_audio", "sample_rate_hz"),
    ("empty_audio", {"type": "input_audio_buffer.append", "audio": ""}, "bad_audio", "audio"),
    ("format", {"type": "input_audio_buffer.append", "audio": pcm16_b64(10), "format": "mp3"},
     "unsupported_audio_format", "format"),
    ("three_frames", {"type": "input_audio_buffer.append", "audio": pcm16_b64(10),
                      "video_frames": [_b64(PNG)] * 3}, "bad_video_frames", "video_frames"),
    ("data_prefix", {"type": "input_audio_buffer.append", "audio": pcm16_b64(10),
                     "video_frames": ["data:image/png;base64," + _b64(PNG)]}, "bad_video_frames", "video_frames[0]"),
    ("not_an_image", {"type": "input_audio_buffer.append", "audio": pcm16_b64(10),
                      "video_frames": [_b64(b"GIF89a")]}, "bad_video_frames", "video_frames[0]"),
    ("ref_audio_path", {"type": "session.update", "session": {"ref_audio": "/tmp/voice.wav"}},
     "unsupported_ref_audio_path", "session.ref_audio"),
    ("ref_audio_path_key", {"type": "session.update", "session": {"extra_body": {"ref_audio_path": "/x"}}},
     "unsupported_ref_audio_path", "session.extra_body.ref_audio_path"),
    ("bad_ref_audio", {"type": "session.update", "session": {"ref_audio": "data:audio/wav;base64,AAAA"}},
     "bad_audio", "session.ref_audio"),
    ("invalid_voice", {"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}},
     "invalid_voice", "session.voice"),
    ("server_owned", {"type": "session.update", "session": {"top_k": 5}}, "server_owned_config_key", "top_k"),
    ("server_owned_extra", {"type": "session.update", "session": {"extra_body": {"max_sessions": 9}}},
     "server_owned_config_key", "max_sessions"),
    ("model_update", {"type": "session.update", "session": {"model": "gpt-4o-realtime"}},
     "model_update_unsupported", "session.model"),
    ("semantic_vad", {"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}},
     "unsupported_turn_detection", "session.turn_detection.type"),
    ("no_interrupt", {"type": "session.update", "session": {"turn_detection": {"type": "server_vad",
                                                                               "interrupt_response": False}}},
     "unsupported_turn_detection", "session.turn_detection.interrupt_response"),
    ("modality", {"type": "session.update", "session": {"output_modalities": ["video"]}},
     "unsupported_response_modality", "session.output_modalities"),
    ("transcription_type", {"type": "session.update", "session": {"type": "transcription"}}, "bad_event",
     "session.type"),
    ("temperature", {"type": "session.update", "session": {"temperature": 3}}, "bad_event", "session.temperature"),
    ("instructions_long", {"type": "session.update", "session": {"instructions": "x" * 32769}}, "bad_event",
     "session.instructions"),
    ("spelling_conflict", {"type": "session.update", "session": {"modalities": ["text"],
                                                                 "output_modalities": ["audio"]}},
     "bad_event", "session.modalities"),
    ("non_native_flag", {"type": "session.update", "session": {"extra_body": {"native_duplex": False}}},
     "unsupported", "session.native_duplex"),
    ("response_option", {"type": "response.create", "response": {"conversation": "none"}},
     "unsupported_response_option", "response.conversation"),
    ("response_voice", {"type": "response.create", "response": {"voice": "other"}},
     "unsupported_response_option", "response.voice"),
    ("response_metadata", {"type": "response.create", "response": {"metadata": {"k": 1}}}, "bad_event",
     "response.metadata"),
    ("response_modality", {"type": "response.create", "response": {"modalities": []}},
     "unsupported_response_modality", "response.modalities"),
    ("response_temperature", {"type": "response.create", "response": {"temperature": 2.5}}, "bad_event",
     "response.temperature"),
    ("response_temperature_bool", {"type": "response.create", "response": {"temperature": True}}, "bad_event",
     "response.temperature"),
    ("response_max_output", {"type": "response.create", "response": {"max_response_output_tokens": 0}}, "bad_event",
     "response.max_response_output_tokens"),
    ("response_stage_metrics", {"type": "response.create", "response": {"extra_body": {"return_stage_metrics": 1}}},
     "bad_event", "response.extra_body.return_stage_metrics"),
    ("response_create_without_input", {"type": "response.create"}, "response_create_without_input", None),
    ("text_append", {"type": "input.text.append", "text": "hi"}, "native_text_append_unsupported", None),
    ("push_text_alias", {"type": "push_text", "text": "hi"}, "native_text_append_unsupported", None),
    ("user_text_item", {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                      "content": [{"type": "input_text"}]}},
     "native_text_append_unsupported", "item.content"),
    ("item_type", {"type": "conversation.item.create", "item": {"type": "function_call"}}, "unsupported_item_type",
     "item"),
    ("missing_item_id", {"type": "conversation.item.retrieve"}, "missing_item_id", "item_id"),
    ("item_not_found", {"type": "conversation.item.delete", "item_id": "item_nope"}, "item_not_found", "item_id"),
    ("ack_unknown", {"type": "playback.ack", "response_id": "resp_x", "played_ms": 5}, "item_not_found", "item_id"),
    ("ack_missing_played", {"type": "playback.ack", "response_id": "resp_x"}, "bad_event", "played_ms"),
    ("truncate_unknown", {"type": "conversation.item.truncate", "item_id": "item_x", "audio_end_ms": 0},
     "item_not_found", "item_id"),
    ("event_ack", {"type": "session.event_ack", "server_event_seq": 99}, "invalid_event_ack", "server_event_seq"),
    ("event_ack_type", {"type": "session.event_ack", "server_event_seq": "1"}, "invalid_event_ack",
     "server_event_seq"),
    ("response_cancel_idle", {"type": "response.cancel"}, "response_not_active", "response_id"),
    ("barge_in_idle", {"type": "barge_in"}, "response_not_active", None),
    ("turn_signal", {"type": "turn.signal", "event": "dance"}, "bad_event", "event"),
    ("session_create_late", {"type": "session.create"}, "bad_event", "type"),
    ("resume_late", {"type": "session.resume"}, "unsupported_session_resume", None),
]


@pytest.mark.parametrize(("name", "frame", "code", "param"), CASES, ids=[c[0] for c in CASES])
async def test_reject_frame_error(name: str, frame: Any, code: str, param: str | None) -> None:
    async with session() as (c, rt):
        if isinstance(frame, dict):
            frame = dict(frame, event_id=frame.get("event_id", f"c-{name}"))
        await c.send(frame if isinstance(frame, str) else json.dumps(frame))
        err = await c.recv()
        assert err["type"] == "error", err
        e = err["error"]
        spec = CODES[code]
        assert (e["code"], e["type"], e["retryable"]) == (code, spec.cls.value, spec.retryable), e
        assert "server_event_seq" not in err  # reject-frame errors are unsequenced (§1.4)
        if param is not None:
            assert e["param"] == param
        if isinstance(frame, dict):
            eid = frame["event_id"]
            assert e["event_id"] == (eid if len(eid) <= 128 else None)  # §1.6: the client event_id is echoed
        # the session is unchanged and alive
        await c.send({"type": "turn.signal", "event": "timeout"})
        ev = await c.recv()
        assert ev["type"] == "turn.event" and ev["epoch"] == 0 and ev["turn_state"] == "idle"
        assert rt.units_seen == [] and [op for op in rt.ops if op[0] in ("append", "update", "cancel")] == []
        events = await close(c)
    assert_conformant(events)
