"""engine_factory entries for the real PyTorch stage engines (`engine: torch` in a deploy profile).

Each returns a StageEngine (model_repository/common/adapter.py: start/submit/drop/stop, `submit`
non-blocking, results through `sink.emit(StageOutput)` then exactly one `sink.close()`) wrapping the
engine/ stage engine, loaded once per model instance with engine.loader.load_checkpoint and driven by
one engine thread (base.py). Payloads the `duplex` pipeline routes (model_repository/common/pipeline.py):
  stage0 -> `decision {action, unit, forced}`, `text {token_id, text, unit}`, for a speak unit
            `tts_input {unit, is_turn_eos, end_of_turn, turn_start, hidden_dim}` with TOKENS = text ids [n]
            and HIDDEN = LLM states [n * hidden_dim], then `unit_done {unit, is_listen, end_of_turn,
            forced, metrics: {thinker: {tokens, ttft_ms, token_times_ms}}}`;
  tts    -> `audio_tokens {unit}` with TOKENS = the unit's audio codes;
  token2wav -> `audio {unit, seq, samples}` with AUDIO = 24 kHz PCM16.
Engine errors map to the codes of docs/triton.md (base.ERROR_CODES). The factories import their module
lazily: a stub loads torch and the one engine it serves. The modules are named `<stage>_bridge` so
that importing one never replaces the factory of the same name on this package.
"""

from __future__ import annotations

from typing import Any

from ..settings import StageSettings


def stage0(settings: StageSettings) -> Any:
    from .stage0_bridge import Stage0Bridge

    return Stage0Bridge(settings)


def tts(settings: StageSettings) -> Any:
    from .tts_bridge import TTSBridge

    return TTSBridge(settings)


def token2wav(settings: StageSettings) -> Any:
    from .token2wav_bridge import Token2WavBridge

    return Token2WavBridge(settings)
