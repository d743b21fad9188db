"""The checkpoint's safetensors key list and shapes, derived from a ModelConfig (model.md §8.3, §8.5).

`expected_keys` is the checkpoint-side view (weight norm of `tts.head_code.*` as g/v parametrizations);
`module_keys` is what `MiniCPMO.state_dict()` holds after fusion. `optional_keys` are accepted by the
loader and dropped; `is_dropped_key` covers the pattern-based optional keys whose shapes are free.
"""

from __future__ import annotations

from typing import Literal

from engine.config import AudioConfig, LLMConfig, ModelConfig, TTSConfig, VisionConfig

Shapes = dict[str, tuple[int, ...]]
HeadCodeFormat = Literal["parametrizations", "weight_g", "fused"]

# Per-output-channel head dim of the resampler's MultiheadAttention (model.md §1.4: heads = hidden/128).
RESAMPLER_HEAD_DIM = 128
_G_V_NAMES: dict[str, tuple[str, str]] = {
    "parametrizations": ("parametrizations.weight.original0", "parametrizations.weight.original1"),
    "weight_g": ("weight_g", "weight_v"),
}


def _linear(prefix: str, out_dim: int, in_dim: int, bias: bool = True) -> Shapes:
    shapes: Shapes = {f"{prefix}.weight": (out_dim, in_dim)}
    if bias:
        shapes[f"{prefix}.bias"] = (out_dim,)
    return shapes


def _norm(prefix: str, dim: int, bias: bool = True) -> Shapes:
    return {f"{prefix}.weight": (dim,), **({f"{prefix}.bias": (dim,)} if bias else {})}


def llm_keys(c: LLMConfig, prefix: str = "llm.") -> Shapes:
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    q = c.num_attention_heads * c.head_dim
    s: Shapes = {f"{prefix}model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"{prefix}model.layers.{i}."
        s |= _norm(p + "input_layernorm", h, bias=False) | _norm(p + "post_attention_layernorm", h, False)
        s |= _linear(p + "self_attn.q_proj", q, h, False) | _linear(p + "self_attn.o_proj", h, q, False)
        s |= _linear(p + "self_attn.k_proj", kv, h, False) | _linear(p + "self_attn.v_proj", kv, h, False)
        s |= _norm(p + "self_attn.q_norm", c.head_dim, False) | _norm(p + "self_attn.k_norm", c.head_dim, False)
        s |= _linear(p + "mlp.gate_proj", c.intermediate_size, h, False)
        s |= _linear(p + "mlp.up_proj", c.intermediate_size, h, False)
        s |= _linear(p + "mlp.down_proj", h, c.intermediate_size, False)
    s |= _norm(f"{prefix}model.norm", h, False) | _linear(f"{prefix}lm_head", c.vocab_size, h, False)
    return s


def audio_keys(a: AudioConfig, llm_hidden: int) -> Shapes:
    d = a.d_model
    s: Shapes = {"apm.conv1.weight": (d, a.num_mel_bins, 3), "apm.conv1.bias": (d,),
                 "apm.conv2.weight": (d, d, 3), "apm.conv2.bias": (d,),
                 "apm.embed_positions.weight": (a.max_source_positions, d)}
    for i in range(a.encoder_layers):
        p = f"apm.layers.{i}."
        for proj in ("q_proj", "v_proj", "out_proj"):
            s |= _linear(p + "self_attn." + proj, d, d)
        s |= _linear(p + "self_attn.k_proj", d, d, bias=False)  # Whisper's k has no bias
        s |= _norm(p + "self_attn_layer_norm", d) | _norm(p + "final_layer_norm", d)
        s |= _linear(p + "fc1", a.encoder_ffn_dim, d) | _linear(p + "fc2", d, a.encoder_ffn_dim)
    s |= _norm("apm.layer_norm", d)
    s |= _linear("audio_projection_layer.linear1", llm_hidden, a.encoder_ffn_dim // 4)
    s |= _linear("audio_projection_layer.linear2", llm_hidden, llm_hidden)
    return s


def vpm_layer_keys(v: VisionConfig, i: int) -> Shapes:
    d, p = v.hidden_size, f"vpm.encoder.layers.{i}."
    s: Shapes = {}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        s |= _linear(p + "self_attn." + proj, d, d)
    s |= _norm(p + "layer_norm1", d) | _norm(p + "layer_norm2", d)
    s |= _linear(p + "mlp.fc1", v.intermediate_size, d) | _linear(p + "mlp.fc2", d, v.intermediate_size)
    return s


def vision_keys(v: VisionConfig, llm_hidden: int) -> Shapes:
    d, e = v.hidden_size, llm_hidden
    s: Shapes = {"vpm.embeddings.patch_embedding.weight": (d, v.num_channels, v.patch_size, v.patch_size),
                 "vpm.embeddings.patch_embedding.bias": (d,),
                 "vpm.embeddings.position_embedding.weight": (v.num_positions, d)}
    for i in range(v.layers_used):
        s |= vpm_layer_keys(v, i)
    s |= _norm("vpm.post_layernorm", d)
    s |= {"resampler.query": (v.query_num, e), "resampler.proj": (e, e)}
    if d != e:  # the reference uses nn.Identity (no weight) when kv_dim == embed_dim
        s |= _linear("resampler.kv_proj", e, d, bias=False)
    s |= {"resampler.attn.in_proj_weight": (3 * e, e), "resampler.attn.in_proj_bias": (3 * e,)}
    s |= _linear("resampler.attn.out_proj", e, e)
    for ln in ("ln_q", "ln_kv", "ln_post"):
        s |= _norm(f"resampler.{ln}", e)
    return s


def _projector(prefix: str, t: TTSConfig) -> Shapes:
    return (_linear(prefix + ".linear1", t.hidden_size, t.llm_dim)
            | _linear(prefix + ".linear2", t.hidden_size, t.hidden_size))


def tts_keys(t: TTSConfig, head_code: HeadCodeFormat = "parametrizations") -> Shapes:
    h = t.hidden_size
    s: Shapes = {"tts.emb_text.weight": (t.num_text_tokens, h)}
    for q in range(t.num_vq):
        s[f"tts.emb_code.{q}.weight"] = (t.num_audio_tokens, h)
        if head_code == "fused":
            s[f"tts.head_code.{q}.weight"] = (t.num_audio_tokens, h)
        else:
            g, v = _G_V_NAMES[head_code]
            s[f"tts.head_code.{q}.{g}"] = (t.num_audio_tokens, 1)
            s[f"tts.head_code.{q}.{v}"] = (t.num_audio_tokens, h)
    s |= _projector("tts.projector_semantic", t)
    # The TTS backbone is a Llama with as many KV heads as query heads in the real config.
    kv = t.num_key_value_heads * t.head_dim
    for i in range(t.num_hidden_layers):
        p = f"tts.model.layers.{i}."
        s |= _linear(p + "self_attn.q_proj", h, h, False) | _linear(p + "self_attn.o_proj", h, h, False)
        s |= _linear(p + "self_attn.k_proj", kv, h, False) | _linear(p + "self_attn.v_proj", kv, h, False)
        s |= _linear(p + "mlp.gate_proj", t.intermediate_size, h, False)
        s |= _linear(p + "mlp.up_proj", t.intermediate_size, h, False)
        s |= _linear(p + "mlp.down_proj", h, t.intermediate_size, False)
        s |= _norm(p + "input_layernorm", h, False) | _norm(p + "post_attention_layernorm", h, False)
    s |= _norm("tts.model.norm", h, False)
    return s


# Size of the unused `tts.model.embed_tokens` (the LlamaConfig default vocab, model.md §1.5).
TTS_UNUSED_VOCAB = 32000


def expected_keys(cfg: ModelConfig, head_code: HeadCodeFormat = "parametrizations") -> Shapes:
    """Every required checkpoint key with its shape (vision keys only when `cfg.vision` is set)."""
    s = llm_keys(cfg.llm) | audio_keys(cfg.audio, cfg.llm.hidden_size)
    if cfg.vision is not None:
        s |= vision_keys(cfg.vision, cfg.llm.hidden_size)
    return s | tts_keys(cfg.tts, head_code)


def module_keys(cfg: ModelConfig) -> Shapes:
    """`MiniCPMO(cfg).state_dict()` keys and shapes: the expected keys with head_code fused."""
    return expected_keys(cfg, head_code="fused")


def optional_keys(cfg: ModelConfig) -> Shapes:
    """Keys accepted with a shape check and then dropped (§8.5)."""
    s: Shapes = _projector("tts.projector_spk", cfg.tts)
    s["tts.model.embed_tokens.weight"] = (TTS_UNUSED_VOCAB, cfg.tts.hidden_size)
    v = cfg.vision
    if v is not None and v.drop_vision_last_layer:
        s |= vpm_layer_keys(v, v.num_hidden_layers - 1)
    return s


def is_dropped_key(key: str, cfg: ModelConfig) -> bool:
    """Pattern-based optional keys whose shape is not checked (§8.5)."""
    if key.endswith("rotary_emb.inv_freq") or key == "resampler.pos_embed":
        return True
    return cfg.vision is None and key.startswith(("vpm.", "resampler."))
