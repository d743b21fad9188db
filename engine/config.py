"""Typed, immutable configs parsed from the real MiniCPM-o 4.5 `config.json` schema (model.md §8.2).

Every parser names the missing or bad field in its error. Unknown keys are accepted and ignored
(with a debug log), as the real file carries many fields the duplex path never reads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config field is missing or has a bad value; the message names the field."""


T = TypeVar("T")

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def _parse(cls: type[T], data: Mapping[str, Any], where: str, **overrides: Any) -> T:
    """Build dataclass `cls` from `data`: fields without a default are required; types are checked."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected an object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        if f.name not in data or data[f.name] is None:
            if f.default is MISSING:
                raise ConfigError(f"{where}.{f.name}: required field is missing")
            continue
        value = data[f.name]
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        expected = _TYPES.get(kind)
        if expected is not None:
            bad_bool = kind in ("int", "float") and isinstance(value, bool)
            if bad_bool or not isinstance(value, expected):
                raise ConfigError(f"{where}.{f.name}: expected {kind}, got {value!r}")
            if kind == "float":
                value = float(value)
        values[f.name] = value
    unknown = sorted(set(data) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
    if unknown:
        log.debug("%s: ignoring keys %s", where, unknown)
    return cls(**values)


def _positive(where: str, **values: int | float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"{where}.{name}: must be > 0, got {value}")


@dataclass(frozen=True)
class LLMConfig:
    """Qwen3 decoder (flat top-level fields of config.json)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        w = "config"
        _positive(w, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                  num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                  vocab_size=self.vocab_size, rope_theta=self.rope_theta)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{w}.num_key_value_heads: must divide num_attention_heads")
        if self.head_dim % 2:
            raise ConfigError(f"{w}.head_dim: must be even (RoPE)")
        if self.hidden_size % 128:
            raise ConfigError(f"{w}.hidden_size: must be a multiple of 128 (resampler heads)")
        if self.hidden_act != "silu":
            raise ConfigError(f"{w}.hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.attention_bias:
            raise ConfigError(f"{w}.attention_bias: must be false for Qwen3")
        if self.tie_word_embeddings:
            raise ConfigError(f"{w}.tie_word_embeddings: MiniCPM-o 4.5 has an untied lm_head")


@dataclass(frozen=True)
class AudioConfig:
    """Whisper encoder (`audio_config`) plus the top-level audio fields."""

    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int
    activation_function: str = "gelu"
    audio_pool_step: int = 5
    audio_chunk_length: float = 1.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        w = "config.audio_config"
        _positive(w, d_model=self.d_model, encoder_layers=self.encoder_layers,
                  encoder_attention_heads=self.encoder_attention_heads)
        if self.encoder_ffn_dim != 4 * self.d_model:
            raise ConfigError(f"{w}.encoder_ffn_dim: must equal 4 * d_model (projector input)")
        if self.d_model % self.encoder_attention_heads:
            raise ConfigError(f"{w}.encoder_attention_heads: must divide d_model")
        if self.num_mel_bins != 80:
            raise ConfigError(f"{w}.num_mel_bins: must be 80, got {self.num_mel_bins}")
        if self.max_source_positions < 152:
            raise ConfigError(f"{w}.max_source_positions: must be >= 152")
        if self.audio_pool_step != 5:
            raise ConfigError(f"config.audio_pool_step: must be 5, got {self.audio_pool_step}")
        if self.activation_function != "gelu":
            raise ConfigError(f"{w}.activation_function: only 'gelu' is supported")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP tower (`vision_config`) plus resampler fields from the top level."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3
    query_num: int = 64
    drop_vision_last_layer: bool = True

    def __post_init__(self) -> None:
        w = "config.vision_config"
        _positive(w, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                  patch_size=self.patch_size, image_size=self.image_size)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{w}.num_attention_heads: must divide hidden_size")

    @property
    def layers_used(self) -> int:
        return self.num_hidden_layers - (1 if self.drop_vision_last_layer else 0)

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class TTSConfig:
    """Speech-token decoder (`tts_config`). Llama fields not in the file take LlamaConfig defaults."""

    llm_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    num_audio_tokens: int
    num_text_tokens: int
    audio_bos_token_id: int
    num_vq: int = 1
    text_eos_token_id: int = -1
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    backbone_model: str = "llama"
    projector_type: str = "mlp"
    normalize_projected_hidden: bool = True

    def __post_init__(self) -> None:
        w = "config.tts_config"
        _positive(w, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                  num_audio_tokens=self.num_audio_tokens, num_text_tokens=self.num_text_tokens)
        if self.num_vq != 1:
            raise ConfigError(f"{w}.num_vq: must be 1, got {self.num_vq}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{w}.num_attention_heads: must divide hidden_size")
        if not 0 <= self.audio_bos_token_id < self.num_text_tokens:
            raise ConfigError(f"{w}.audio_bos_token_id: must be in [0, num_text_tokens)")
        if self.backbone_model != "llama":
            raise ConfigError(f"{w}.backbone_model: only 'llama' is supported")
        if self.projector_type != "mlp":
            raise ConfigError(f"{w}.projector_type: only 'mlp' is supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_code(self) -> int:
        """The code EOS is the last row of the code vocabulary (model.md §1.5)."""
        return self.num_audio_tokens - 1


@dataclass(frozen=True)
class ModelConfig:
    """The whole `config.json`: flat Qwen3 fields plus nested audio, vision and TTS configs."""

    llm: LLMConfig
    audio: AudioConfig
    tts: TTSConfig
    vision: VisionConfig | None
    model_type: str = "minicpmo"
    version: str = "4.5"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, with_vision: bool = True) -> ModelConfig:
        if data.get("model_type") != "minicpmo":
            raise ConfigError(f"config.model_type: expected 'minicpmo', got {data.get('model_type')!r}")
        if not data.get("architectures"):
            raise ConfigError("config.architectures: required field is missing")
        llm = _parse(LLMConfig, data, "config")
        for key in ("audio_config", "tts_config"):
            if key not in data:
                raise ConfigError(f"config.{key}: required field is missing")
        audio = _parse(AudioConfig, data["audio_config"], "config.audio_config",
                       audio_pool_step=_top(data, "audio_pool_step", int),
                       audio_chunk_length=float(_top(data, "audio_chunk_length", (int, float))))
        tts = _parse(TTSConfig, data["tts_config"], "config.tts_config")
        if tts.llm_dim != llm.hidden_size:
            raise ConfigError("config.tts_config.llm_dim: must equal hidden_size "
                              f"({tts.llm_dim} != {llm.hidden_size})")
        if tts.num_text_tokens < llm.vocab_size:
            raise ConfigError("config.tts_config.num_text_tokens: must be >= vocab_size")
        vision = None
        if with_vision and data.get("init_vision", True):
            if "vision_config" not in data:
                raise ConfigError("config.vision_config: required field is missing")
            vision = _parse(VisionConfig, data["vision_config"], "config.vision_config",
                            query_num=_top(data, "query_num", int),
                            drop_vision_last_layer=_top(data, "drop_vision_last_layer", bool))
        return cls(llm=llm, audio=audio, tts=tts, vision=vision,
                   version=str(data.get("version", "4.5")))

    @classmethod
    def from_file(cls, path: str | Path, *, with_vision: bool = True) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(data, with_vision=with_vision)


def _top(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise ConfigError(f"config.{key}: required field is missing")
    value = data[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ConfigError(f"config.{key}: bad value {value!r}")
    return value
