import base64
import io
import json

import numpy as np
import soundfile as sf

from clients.events import (
    AudioDelta,
    ErrorEvent,
    OtherEvent,
    ResponseCreated,
    ResponseDone,
    ResponseListen,
    SessionCreated,
    SessionEnded,
    TextDelta,
    parse_event,
)


def test_nested_and_flat_errors_parse_to_the_same_fields() -> None:
    nested = {"type": "error", "event_id": "evt_1", "error": {"type": "invalid_request_error",
              "code": "input_audio_buffer_empty", "message": "m", "param": None, "event_id": "c-17",
              "retryable": False}}
    flat = {"type": "error", "event_id": "evt_2", "error": "m", "code": "input_audio_buffer_empty",
            "error_type": "invalid_request_error", "retryable": False, "param": None, "client_event_id": "c-17"}
    a, b = parse_event(nested), parse_event(flat)
    assert isinstance(a, ErrorEvent) and isinstance(b, ErrorEvent)
    assert (a.code, a.message, a.error_type, a.client_event_id) == (b.code, b.message, b.error_type,
                                                                    b.client_event_id)
    assert a.seq is None


def test_beta_names_map_to_ga_and_envelope_is_kept() -> None:
    pcm = (np.arange(480) % 50).astype("<i2").tobytes()
    raw = {"type": "response.audio.delta", "event_id": "evt_9", "server_event_seq": 36, "response_id": "r1",
           "item_id": "item_r1", "delta": base64.b64encode(pcm).decode(), "format": "pcm16",
           "sample_rate_hz": 24000, "metadata": {"model_unit_index": 5}}
    ev = parse_event(raw)
    assert isinstance(ev, AudioDelta) and ev.type == "response.output_audio.delta"
    assert (ev.event_id, ev.seq, ev.pcm16) == ("evt_9", 36, pcm)
    assert ev.duration_ms == 20.0  # 480 samples at 24 kHz, derived from the decoded length
    td = parse_event({"type": "response.audio_transcript.delta", "response_id": "r1", "delta": "hi"})
    assert isinstance(td, TextDelta) and td.type == "response.output_audio_transcript.delta"


def test_wav_and_f32_audio_deltas_decode_to_pcm16() -> None:
    x = np.sin(np.arange(2400) * 0.01).astype(np.float32) * 0.5
    buf = io.BytesIO()
    sf.write(buf, x, 24000, format="WAV", subtype="PCM_16")
    wav = parse_event({"type": "response.output_audio.delta", "response_id": "r", "format": "wav",
                       "delta": base64.b64encode(buf.getvalue()).decode()})
    f32 = parse_event({"type": "response.output_audio.delta", "response_id": "r", "format": "pcm_f32le",
                       "sample_rate_hz": 24000, "delta": base64.b64encode(x.astype("<f4").tobytes()).decode()})
    assert isinstance(wav, AudioDelta) and isinstance(f32, AudioDelta)
    a = np.frombuffer(wav.pcm16, "<i2").astype(int)
    b = np.frombuffer(f32.pcm16, "<i2").astype(int)
    assert wav.sample_rate_hz == 24000 and len(a) == len(b) == 2400
    assert np.max(np.abs(a - b)) <= 1


def test_response_lifecycle_events() -> None:
    created = parse_event({"type": "response.created", "server_event_seq": 31, "response": {
        "id": "resp_a1", "status": "in_progress", "duplex": {"trigger": "model", "epoch": 0}}})
    assert isinstance(created, ResponseCreated) and (created.response_id, created.trigger) == ("resp_a1", "model")
    done = parse_event(json.loads(
        '{"type":"response.done","server_event_seq":45,"response":{"id":"resp_a1","status":"cancelled",'
        '"status_details":{"type":"cancelled","reason":"client_cancelled"},"output":[{"id":"item_resp_a1",'
        '"type":"message","content":[{"type":"output_audio","transcript":"Sure, one "}]}],'
        '"duplex":{"reason":"barge_in","stage_metrics":{"0":{"ttft_ms":41.7}}}}}'))
    assert isinstance(done, ResponseDone)
    assert (done.status, done.reason, done.transcript) == ("cancelled", "barge_in", "Sure, one ")
    listen = parse_event({"type": "response.listen", "response_id": None, "model_unit_index": 4,
                          "response": {"id": None, "status": "listening", "metadata": {"reason": "model_listen"}}})
    assert isinstance(listen, ResponseListen) and listen.reason == "model_listen"


def test_session_and_unknown_events() -> None:
    created = parse_event({"type": "session.created", "session": {"id": "sess_1"}, "incarnation": 1,
                           "attachment_generation": 1, "resume_token": "t" * 43})
    assert isinstance(created, SessionCreated) and created.session_id == "sess_1"
    resumed = parse_event({"type": "session.resumed", "session_id": "sess_1", "session": {"id": "sess_1"},
                           "attachment_generation": 2, "resume_token": "u" * 43, "replay_count": 4})
    assert isinstance(resumed, SessionCreated) and resumed.type == "session.resumed" and resumed.replay_count == 4
    closed = parse_event({"type": "session.closed", "server_event_seq": 9, "session_id": "s", "reason": "client_close"})
    assert isinstance(closed, SessionEnded) and closed.reason == "client_close"
    other = parse_event({"type": "overlap.decision", "server_event_seq": 3, "action": "listen"})
    assert isinstance(other, OtherEvent) and other.type == "overlap.decision" and other.raw["action"] == "listen"


def test_native_profile_events_normalise_to_ga_types() -> None:
    pcm = np.zeros(240, "<i2").tobytes()
    delta = parse_event({"type": "response.output_audio.delta", "server_event_seq": 5, "response_id": "r",
                         "audio": base64.b64encode(pcm).decode(), "audio_transcript": "Hi ", "format": "pcm16",
                         "sample_rate_hz": 24000, "model_unit_index": 3, "model_speak": True})
    assert isinstance(delta, AudioDelta) and delta.transcript == "Hi " and delta.pcm16 == pcm
    created = parse_event({"type": "response.created", "response_id": "r", "trigger": "model", "epoch": 1})
    assert isinstance(created, ResponseCreated) and (created.response_id, created.epoch) == ("r", 1)
    done = parse_event({"type": "response.done", "response_id": "r", "status": "completed", "transcript": "Hi ",
                        "duplex": {"reason": "turn_end"}})
    assert isinstance(done, ResponseDone) and (done.transcript, done.reason) == ("Hi ", "turn_end")
    cancelled = parse_event({"type": "audio.cancelled", "response_id": "r", "reason": "barge_in",
                             "transcript": "Hi"})
    assert isinstance(cancelled, ResponseDone) and cancelled.type == "response.done"
    assert (cancelled.status, cancelled.reason, cancelled.raw["type"]) == ("cancelled", "barge_in", "audio.cancelled")
    assert parse_event({"type": "output.cleared", "response_id": "r"}).type == "output_audio_buffer.cleared"
