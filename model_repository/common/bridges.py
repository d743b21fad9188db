"""engine_factory entries for the real PyTorch stage engines (`engine: torch` in a deploy profile).

Each returns a StageEngine (model_repository/common/adapter.py: start/submit/drop/stop, `submit`
non-blocking, results through `sink.emit(StageOutput)` then exactly one `sink.close()`) wrapping the
engine/ stage engine, loaded with engine.loader.load_checkpoint(settings.checkpoint_dir, device=...).
Payloads the `duplex` pipeline routes (model_repository/common/pipeline.py):
  stage0 -> event {"type": "tts_input", "unit", "is_turn_eos": [...], "end_of_turn", "turn_start",
            "hidden_dim"} with TOKENS = text ids [n] and HIDDEN = LLM states [n * hidden_dim] (flattened);
  tts    -> event {"type": "audio_tokens", "unit"} with TOKENS = audio token ids;
  token2wav -> event {"type": "audio", "unit", "seq", "samples"} with AUDIO = 24 kHz PCM16.
Engine errors map to the codes of docs/triton.md (the engines' `code` attributes).
"""

from __future__ import annotations

from .settings import ConfigError, StageSettings


def _not_wired(settings: StageSettings) -> ConfigError:
    return ConfigError(f"stage {settings.stage!r}: the engine/ stage engine is not wired into Triton yet; "
                       "serve with `--profile deploy/profiles/loopback.yaml` meanwhile")


def stage0(settings: StageSettings):
    raise _not_wired(settings)


def tts(settings: StageSettings):
    raise _not_wired(settings)


def token2wav(settings: StageSettings):
    raise _not_wired(settings)
