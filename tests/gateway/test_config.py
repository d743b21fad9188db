"""Session configuration spellings and validation (protocol.md §2.2-§2.6)."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.protocol.config import ConfigContext, apply_patch, default_config
from gateway.protocol.errors import ProtocolError

CTX = ConfigContext(served_model="m", model_aliases=("m-alias",), voices=("default", "v2"),
                    default_voice_available=True, idle_ttl_s=300.0, force_listen_count=3,
                    default_input_rate_hz=24000, default_output_format="pcm16")


def _apply(session: dict, **kw) -> object:  # noqa: ANN003
    return apply_patch(default_config(CTX), session, CTX, opening=kw.get("opening", False),
                       prefix_committed=kw.get("prefix", False))[0]


def test_beta_ga_and_native_spellings_agree() -> None:
    beta = _apply({"modalities": ["text"], "input_audio_format": "pcm16", "input_audio_sample_rate_hz": 16000,
                   "voice": "v2", "max_response_output_tokens": 50, "turn_detection": None})
    ga = _apply({"output_modalities": ["text"], "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                                                                   "turn_detection": None},
                                                         "output": {"voice": {"id": "v2"}}},
                 "max_output_tokens": 50})
    native = _apply({"modalities": ["text"], "sample_rate_hz": 16000, "voice": "v2",
                     "max_output_tokens": 50})
    same_seed = {"seed": beta.seed}  # each default config draws its own random seed
    assert beta == dataclasses.replace(ga, **same_seed) == dataclasses.replace(native, **same_seed)
    assert ga.text_only and ga.input_audio_sample_rate_hz == 16000 and ga.voice == "v2"


def test_defaults_and_coercions() -> None:
    cfg = _apply({"overlap_policy": "bogus", "idle_timeout_s": 9999, "audio": {"input": {
        "format": {"type": "audio/pcmu"}}}})
    assert cfg.overlap_policy == "listen_only" and cfg.idle_timeout_s == 300.0
    assert cfg.input_audio_format == "g711_ulaw" and cfg.input_audio_sample_rate_hz == 8000
    assert cfg.force_listen_count == 3 and cfg.output_modalities == ("audio",)
    vad = _apply({"turn_detection": {"type": "server_vad", "create_response": False}})
    assert vad.effective_overlap_policy == "barge_in_on_speech" and vad.effective_auto_response is False


@pytest.mark.parametrize(("session", "code"), [
    ({"extra_body": {"auto_response": True}, "auto_response": False}, "bad_event"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "unsupported_audio_format"),
    ({"output_audio_format": "opus"}, "unsupported_audio_format"),
    ({"overlap_short_ack_ms": 900, "overlap_barge_in_ms": 800}, "bad_event"),
    ({"tool_choice": "required"}, "bad_event"),
    ({"input_audio_sample_rate_hz": 96000}, "bad_event"),
    ({"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5}}, "unsupported_turn_detection"),
    ({"seed": -1}, "bad_event"),
    ({"extra_body": {"seed": 2**63}}, "bad_event"),
    ({"seed": True}, "bad_event"),
    ({"top_k": 5}, "server_owned_config_key"),
])
def test_invalid_sessions(session: dict, code: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        _apply(session)
    assert exc.value.code == code


def test_model_alias_and_locks() -> None:
    assert _apply({"model": "m-alias"}).model == "m"  # an alias and the id it names agree
    with pytest.raises(ProtocolError) as exc:
        _apply({"model": "other"}, opening=True)
    assert exc.value.code == "model_not_found"
    cfg = _apply({"instructions": "Streaming Omni Conversation."}, prefix=True)  # unchanged locked value
    assert cfg.instructions == "Streaming Omni Conversation."


def test_seed_is_random_per_session_unless_given_and_locked_at_the_prefix_commit() -> None:
    assert len({default_config(CTX).seed for _ in range(8)}) == 8  # a fresh random seed per session
    given = _apply({"extra_body": {"seed": 42}})
    assert given.seed == 42 and _apply({"seed": 42}).seed == 42
    assert _apply({"seed": None}).seed != _apply({"seed": None}).seed  # null asks for a fresh random one
    again, touched = apply_patch(given, {"seed": 42}, CTX, opening=False, prefix_committed=True)
    assert again.seed == 42 and "seed" in touched  # the same value after the commit is no change
    with pytest.raises(ProtocolError) as exc:
        apply_patch(given, {"seed": 7}, CTX, opening=False, prefix_committed=True)
    assert exc.value.code == "bad_event" and exc.value.param == "session.seed"
