"""Token2Wav configs (model.md §1.6, §1.7, §6, §8.4) and the restricted `flow.yaml` parser.

`flow.yaml` is a hyperpyyaml file. We never evaluate it: a SafeLoader maps exactly the four `!new:`
tags of §8.4 to plain records; every other tag (`!ref`, `!apply`, `!name`, other `!new:` targets)
is rejected. Flow sizes come from the file; HiFT sizes are inferred from the weights (assets.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from engine.config import ConfigError

FLOW_TAG = "cosyvoice2.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_TAG = "cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2"
DECODER_TAG = "cosyvoice2.flow.flow_matching.CausalConditionalCFM"
ESTIMATOR_TAG = "cosyvoice2.flow.decoder_dit.DiT"
_TAGS = (FLOW_TAG, ENCODER_TAG, DECODER_TAG, ESTIMATOR_TAG)

# Fields present in the real file that do not change inference (dropouts, fixed layer kinds).
_IGNORED = {
    FLOW_TAG: {"output_type", "input_frame_rate", "only_mask_loss", "token_mel_ratio"},
    ENCODER_TAG: {"dropout_rate", "positional_dropout_rate", "attention_dropout_rate", "input_layer",
                  "pos_enc_layer_type", "selfattention_layer_type", "key_bias", "normalize_before",
                  "activation_type", "up_scale_factor", "use_cnn_module", "macaron_style",
                  "static_chunk_size", "use_dynamic_chunk", "use_dynamic_left_chunk"},
    DECODER_TAG: {"in_channels", "n_spks", "spk_emb_dim", "cfm_params", "t_scheduler",
                  "training_cfg_rate", "sigma_min", "solver"},
    ESTIMATOR_TAG: set(),
}
# Values of ignored-but-checked fields that our implementation hard-wires.
_FIXED = {"input_layer": "linear", "pos_enc_layer_type": "rel_pos_espnet",
          "selfattention_layer_type": "rel_selfattn", "key_bias": True, "normalize_before": True}


@dataclass(frozen=True)
class FlowConfig:
    """`CausalMaskedDiffWithXvec` + encoder + CFM + DiT sizes (full-size defaults of §1.6)."""

    vocab_size: int = 6561
    input_size: int = 512            # token embedding dim = encoder input
    mel_dim: int = 80                # flow `output_size`
    spk_embed_dim: int = 192
    # encoder (UpsampleConformerEncoderV2)
    enc_dim: int = 512
    enc_heads: int = 8
    enc_linear_units: int = 2048
    enc_blocks: int = 6
    enc_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2
    # CFM
    cfg_rate: float = 0.7
    # estimator (DiT)
    dit_in_channels: int = 320
    dit_out_channels: int = 80
    dit_hidden: int = 512
    dit_depth: int = 16
    dit_heads: int = 8
    dit_head_dim: int = 64
    dit_mlp_ratio: float = 4.0
    # constants of the reference classes (not in flow.yaml)
    pre_lookahead_conv2_kernel: int = 3      # causal conv after the look-ahead conv (2-frame history)
    dit_conv_kernel: int = 3                 # DiT causal ConvBlock kernel (2-frame history)
    t_freq_dim: int = 256                    # timestep sinusoid width
    t_scale: float = 1000.0                  # t is scaled before the sinusoid
    t_max_period: float = 10000.0
    rel_pos_max_len: int = 5000              # EspnetRelPositionalEncoding table (tokens + cache)
    noise_frames: int = 30000                # `rand_noise` [1, 80, 30000] (600 s at 50 Hz)
    enc_ln_eps: float = 1e-5                 # input layer / after_norm
    block_ln_eps: float = 1e-12              # conformer norm_mha / norm_ff
    dit_ln_eps: float = 1e-6                 # DiT norm1/2/3 and final norm
    qk_ln_eps: float = 1e-5
    leaky_slope: float = 0.01

    def __post_init__(self) -> None:
        # the streaming silence prefix feeds `silence_code` to the token embedding (C7)
        silence = StreamConfig.silence_code
        checks = {
            f"vocab_size > silence_code = {silence} (C7)": self.vocab_size > silence,
            "dit_in_channels == 4 * mel_dim (C8)": self.dit_in_channels == 4 * self.mel_dim,
            "dit_out_channels == mel_dim (C8)": self.dit_out_channels == self.mel_dim,
            "enc_dim % enc_heads == 0 (C8)": self.enc_dim % self.enc_heads == 0,
            "pre_lookahead_len == 3 (C8)": self.pre_lookahead_len == 3,
            "up_stride == 2 (C8)": self.up_stride == 2,
            "spk_embed_dim == 192 (C10)": self.spk_embed_dim == 192,
            "input_size == enc_dim": self.input_size == self.enc_dim,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"FlowConfig violates: {', '.join(bad)}")

    @property
    def enc_cnn_cache_len(self) -> int:
        # 2 frames for the pre-lookahead conv2 + 2·stride for the upsample conv
        return (self.pre_lookahead_conv2_kernel - 1) + 2 * self.up_stride


@dataclass(frozen=True)
class HiFTConfig:
    """HiFT generator (§1.7). Only the two channel counts vary; they are inferred from the weights."""

    base_channels: int = 512
    f0_cond_channels: int = 512
    in_channels: int = 80
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[int, ...] = (1, 3, 5)
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    f0_layers: int = 5
    lrelu_slope: float = 0.1
    post_lrelu_slope: float = 0.01
    audio_limit: float = 0.99
    magnitude_clip: float = 100.0

    def __post_init__(self) -> None:
        ups = 1
        for r in self.upsample_rates:
            ups *= r
        if self.in_channels != 80 or ups * self.istft_hop != 480 or self.base_channels % 8:
            raise ConfigError("HiFTConfig violates C9 (in 80, upsample x hop = 480, base % 8 == 0)")

    @property
    def samples_per_frame(self) -> int:
        ups = 1
        for r in self.upsample_rates:
            ups *= r
        return ups * self.istft_hop


FlowCacheTrim = Literal["reference", "prompt_plus_recent"]
ConformerCacheTrim = Literal["v0.1.2", "v1.0.7"]
ForceFlush = Literal["always", "turn_start"]


@dataclass(frozen=True)
class StreamConfig:
    """Streaming rules of §6.2–§6.7, with options for three reference quirks: the estimator cache trim (Q17),
    the conformer cache trim (Q18) and when to force-flush the code buffer (Q19)."""

    silence_code: int = 4218
    prefix_len: int = 3                       # silence codes before a turn (= pre_lookahead_len)
    chunk_new: int = 25                       # new codes per steady-state call
    min_flush: int = 8                        # buffer >= prefix_len + 5 triggers a call
    n_timesteps: int = 5
    cache_keep_frames: int = 100              # trims keep P + this many mel frames
    mel_cache_frames: int = 8                 # HiFT overlap (160 ms)
    flow_cache_trim: FlowCacheTrim = "reference"
    conformer_cache_trim: ConformerCacheTrim = "v0.1.2"
    force_flush: ForceFlush = "always"
    # the base cache pads the prompt with silence codes (layout A) or its own first codes (layout B, §6.10)
    prompt_pad: Literal["silence", "prompt_head"] = "silence"
    first_hop: int = 0                        # > 0: a turn's first call takes prefix + this many codes
    flow_noise_seed: int = 0
    unit_samples: int = 24000                 # 1 s at 24 kHz
    pcm_scale: float = 32767.0
    pcm_unscale: float = 32768.0

    def __post_init__(self) -> None:
        if self.n_timesteps < 1:
            raise ConfigError("StreamConfig.n_timesteps must be >= 1")
        if self.flow_cache_trim not in ("reference", "prompt_plus_recent"):
            raise ConfigError(f"flow_cache_trim: bad value {self.flow_cache_trim!r}")
        if self.conformer_cache_trim not in ("v0.1.2", "v1.0.7"):
            raise ConfigError(f"conformer_cache_trim: bad value {self.conformer_cache_trim!r}")
        if self.first_hop and not 2 <= self.first_hop <= self.chunk_new:
            raise ConfigError(f"first_hop must be 0 or in [2, {self.chunk_new}], got {self.first_hop}")
        if self.force_flush not in ("always", "turn_start"):
            raise ConfigError(f"force_flush: bad value {self.force_flush!r}")

    @property
    def chunk_call(self) -> int:
        return self.chunk_new + self.prefix_len


# ---------------------------------------------------------------- restricted flow.yaml parser
@dataclass(frozen=True)
class _Node:
    tag: str
    kwargs: dict[str, Any]


class _FlowYamlLoader(yaml.SafeLoader):
    """SafeLoader + exactly four `!new:` tags; anything else stays an error (SafeLoader default)."""


def _construct_new(loader: _FlowYamlLoader, suffix: str, node: yaml.Node) -> _Node:
    if suffix not in _TAGS:
        raise ConfigError(f"flow.yaml: tag !new:{suffix} is not allowed")
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"flow.yaml: !new:{suffix} must have keyword arguments")
    return _Node(suffix, loader.construct_mapping(node, deep=True))


_FlowYamlLoader.add_multi_constructor("!new:", _construct_new)


def _take(node: Any, tag: str, where: str) -> dict[str, Any]:
    if not isinstance(node, _Node) or node.tag != tag:
        raise ConfigError(f"flow.yaml: {where} must be !new:{tag}")
    return dict(node.kwargs)


def _pop(kw: dict[str, Any], key: str, where: str, default: Any = None) -> Any:
    if key not in kw:
        if default is None:
            raise ConfigError(f"flow.yaml: {where}.{key} is missing")
        return default
    return kw.pop(key)


def _check_rest(kw: dict[str, Any], tag: str, where: str) -> None:
    for key in list(kw):
        if key in _FIXED and kw[key] != _FIXED[key]:
            raise ConfigError(f"flow.yaml: {where}.{key} = {kw[key]!r} unsupported (want {_FIXED[key]!r})")
    unknown = sorted(set(kw) - _IGNORED[tag])
    if unknown:
        raise ConfigError(f"flow.yaml: {where} has unknown keys {unknown}")


def parse_flow_yaml(text: str) -> FlowConfig:
    """FlowConfig from `flow.yaml` text; raises ConfigError on any disallowed tag or field."""
    try:
        doc = yaml.load(text, Loader=_FlowYamlLoader)  # noqa: S506 - restricted SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"flow.yaml: {exc}") from exc
    if not isinstance(doc, dict) or "flow" not in doc:
        raise ConfigError("flow.yaml: top-level `flow` entry is missing")
    flow = _take(doc["flow"], FLOW_TAG, "flow")
    enc = _take(flow.pop("encoder", None), ENCODER_TAG, "flow.encoder")
    dec = _take(flow.pop("decoder", None), DECODER_TAG, "flow.decoder")
    est = _take(dec.pop("estimator", None), ESTIMATOR_TAG, "flow.decoder.estimator")
    if flow.pop("input_embedding", None) is not None:
        raise ConfigError("flow.yaml: a custom input_embedding is not supported")
    values = dict(
        vocab_size=_pop(flow, "vocab_size", "flow"),
        input_size=_pop(flow, "input_size", "flow"),
        mel_dim=_pop(flow, "output_size", "flow"),
        spk_embed_dim=_pop(flow, "spk_embed_dim", "flow"),
        enc_dim=_pop(enc, "output_size", "flow.encoder"),
        enc_heads=_pop(enc, "attention_heads", "flow.encoder"),
        enc_linear_units=_pop(enc, "linear_units", "flow.encoder"),
        enc_blocks=_pop(enc, "num_blocks", "flow.encoder"),
        enc_up_blocks=_pop(enc, "num_up_blocks", "flow.encoder"),
        pre_lookahead_len=_pop(enc, "pre_lookahead_len", "flow.encoder"),
        up_stride=_pop(enc, "up_stride", "flow.encoder"),
        cfg_rate=float(_pop(dec, "inference_cfg_rate", "flow.decoder")),
        dit_in_channels=_pop(est, "in_channels", "flow.decoder.estimator"),
        dit_out_channels=_pop(est, "out_channels", "flow.decoder.estimator"),
        dit_hidden=_pop(est, "hidden_size", "flow.decoder.estimator"),
        dit_depth=_pop(est, "depth", "flow.decoder.estimator"),
        dit_heads=_pop(est, "num_heads", "flow.decoder.estimator"),
        dit_head_dim=_pop(est, "head_dim", "flow.decoder.estimator"),
        dit_mlp_ratio=float(_pop(est, "mlp_ratio", "flow.decoder.estimator")),
    )
    if enc.pop("input_size", values["input_size"]) != values["input_size"]:
        raise ConfigError("flow.yaml: flow.encoder.input_size != flow.input_size")
    for kw, tag, where in ((flow, FLOW_TAG, "flow"), (enc, ENCODER_TAG, "flow.encoder"),
                           (dec, DECODER_TAG, "flow.decoder"), (est, ESTIMATOR_TAG, "flow.decoder.estimator")):
        _check_rest(kw, tag, where)
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"flow.yaml: {name} must be a number, got {value!r}")
    return FlowConfig(**values)


def load_flow_yaml(path: Path) -> FlowConfig:
    return parse_flow_yaml(Path(path).read_text())


def flow_yaml_text(cfg: FlowConfig) -> str:
    """The `flow.yaml` text (hyperpyyaml tags, field names of the reference classes) for `cfg`."""
    return (
        f"flow: !new:{FLOW_TAG}\n"
        f"    input_size: {cfg.input_size}\n    output_size: {cfg.mel_dim}\n"
        f"    spk_embed_dim: {cfg.spk_embed_dim}\n    output_type: 'mel'\n    vocab_size: {cfg.vocab_size}\n"
        f"    encoder: !new:{ENCODER_TAG}\n"
        f"        input_size: {cfg.input_size}\n        output_size: {cfg.enc_dim}\n"
        f"        input_layer: 'linear'\n        pre_lookahead_len: {cfg.pre_lookahead_len}\n"
        f"        num_blocks: {cfg.enc_blocks}\n        num_up_blocks: {cfg.enc_up_blocks}\n"
        f"        up_stride: {cfg.up_stride}\n        up_scale_factor: {cfg.up_stride}\n"
        f"        attention_heads: {cfg.enc_heads}\n        pos_enc_layer_type: 'rel_pos_espnet'\n"
        f"        selfattention_layer_type: 'rel_selfattn'\n        key_bias: true\n"
        f"        linear_units: {cfg.enc_linear_units}\n        dropout_rate: 0.1\n"
        f"        positional_dropout_rate: 0.1\n        attention_dropout_rate: 0.1\n"
        f"        normalize_before: true\n"
        f"    decoder: !new:{DECODER_TAG}\n"
        f"        inference_cfg_rate: {cfg.cfg_rate}\n"
        f"        estimator: !new:{ESTIMATOR_TAG}\n"
        f"            in_channels: {cfg.dit_in_channels}\n            out_channels: {cfg.dit_out_channels}\n"
        f"            mlp_ratio: {cfg.dit_mlp_ratio}\n            depth: {cfg.dit_depth}\n"
        f"            num_heads: {cfg.dit_heads}\n            head_dim: {cfg.dit_head_dim}\n"
        f"            hidden_size: {cfg.dit_hidden}\n"
    )


TINY_FLOW = FlowConfig(input_size=32, enc_dim=32, enc_heads=2, enc_linear_units=64, enc_blocks=1,
                       enc_up_blocks=1, dit_hidden=32, dit_depth=2, dit_heads=2, dit_head_dim=16)

