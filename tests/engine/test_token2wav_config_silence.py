"""FlowConfig's C7 check derives its bound and message from StreamConfig.silence_code (no literal)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ConfigError
from engine.token2wav.config import FlowConfig, StreamConfig


def test_vocab_must_contain_the_silence_code() -> None:
    silence = StreamConfig().silence_code
    FlowConfig(vocab_size=silence + 1)  # the smallest vocabulary that embeds the silence prefix
    with pytest.raises(ConfigError, match=f"vocab_size > silence_code = {silence} ") as err:
        FlowConfig(vocab_size=silence)
    assert "C7" in str(err.value)


def test_bound_follows_the_field_default(monkeypatch: pytest.MonkeyPatch) -> None:
    field = next(f for f in dataclasses.fields(StreamConfig) if f.name == "silence_code")
    monkeypatch.setattr(StreamConfig, "silence_code", field.default - 1)
    FlowConfig(vocab_size=field.default)  # now large enough
    with pytest.raises(ConfigError, match=f"silence_code = {field.default - 1} "):
        FlowConfig(vocab_size=field.default - 1)
