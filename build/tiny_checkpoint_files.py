"""Contents of the tiny checkpoint's JSON and tokenizer files (model.md §8.2, §9.2, §9.3).

The config uses the real `config.json` schema: flat Qwen3 fields, nested `audio_config`,
`vision_config` and `tts_config`, plus the extra keys the real file carries (which the parser ignores).
"""

from __future__ import annotations

from typing import Any

# §9.3: byte symbols take ids 0..255; the added tokens follow in this (non-real) order.
TINY_ADDED_TOKENS = (
    "<|endoftext|>", "<unk>", "<|im_end|>", "<|im_start|>", "<|listen|>", "<|speak|>", "</unit>", "<unit>",
    "<|chunk_eos|>", "<|turn_eos|>", "<|tts_bos|>", "<|tts_eos|>", "<|chunk_tts_eos|>", "<|tts_pad|>",
    "<|audio_end|>", "<|audio|>", "<|audio_start|>", "</image>", "<image>", "</slice>", "<slice>",
    "<think>", "</think>", "<|interrupt|>", "<|turn_bos|>", "<|chunk_bos|>", "<|chunk_tts_bos|>",
    "<|spk_bos|>", "<|spk|>", "<|spk_eos|>",
)
BYTE_SYMBOLS = 256
TINY_BAD_TOKEN_IDS = [0, 1, 2]  # three byte ids: a short non-empty Step-B mask (§4.3)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "minicpmo", "architectures": ["MiniCPMO"], "version": "4.5",
    "auto_map": {"AutoConfig": "configuration_minicpmo.MiniCPMOConfig",
                 "AutoModel": "modeling_minicpmo.MiniCPMO"},
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 2, "initializer_range": 0.02, "transformers_version": "4.51.0",
    "query_num": 64, "image_size": 448, "drop_vision_last_layer": True, "batch_vision_input": True,
    "use_image_id": True, "vision_batch_size": 16, "audio_pool_step": 5, "audio_chunk_length": 1.0,
    "stream_input": True, "listen_speak_type": "asr", "init_vision": True, "init_audio": True,
    "init_tts": True,
    "slice_config": {"patch_size": 14, "max_slice_nums": 9, "scale_resolution": 448,
                     "model_type": "minicpmv"},
    "audio_config": {
        "model_type": "whisper", "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4,
        "encoder_ffn_dim": 256, "num_mel_bins": 80, "max_source_positions": 1500,
        "activation_function": "gelu", "decoder_layers": 2, "decoder_attention_heads": 4,
        "decoder_ffn_dim": 256, "max_target_positions": 448, "vocab_size": 51865, "dropout": 0.0,
    },
    "vision_config": {
        "model_type": "siglip", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "patch_size": 14, "image_size": 28, "layer_norm_eps": 1e-06,
        "hidden_act": "gelu_pytorch_tanh", "num_channels": 3, "attention_dropout": 0.0,
    },
    "tts_config": {
        "model_type": "minicpmtts", "llm_dim": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "num_audio_tokens": 6562, "num_text_tokens": 320, "num_vq": 1,
        "projector_type": "mlp", "backbone_model": "llama", "audio_bos_token_id": 317,
        "text_eos_token_id": 318, "normalize_projected_hidden": True, "top_p": 0.85, "top_k": 25,
        "repetition_penalty": 1.05, "s3_stream_chunk_size": 25, "s3_stream_generate": False,
        "s3_stream_n_timesteps": 10, "s3_stream_prelook_size": 3, "attention_type": "sliding_recompute",
        "window_size": 2, "recomputed_chunks": 1, "streaming": True, "audio_tokenizer_type": "s3tokenizer",
        "condition_type": "hidden_text_merge", "use_llm_hidden_state": False, "use_text": True,
        "interleaved": False, "num_mel_bins": 100,
    },
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / Qwen2 byte-level alphabet: printable bytes map to themselves, the rest above 255."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(BYTE_SYMBOLS):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(BYTE_SYMBOLS + extra)
            extra += 1
    return table


def tokenizer_files() -> dict[str, Any]:
    """File name -> JSON object (or text) of the tiny byte-level BPE tokenizer."""
    vocab = {sym: b for b, sym in bytes_to_unicode().items()}
    added = {tok: BYTE_SYMBOLS + i for i, tok in enumerate(TINY_ADDED_TOKENS)}
    decoder = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for tok, i in added.items()}
    # §4.3: every tiny added token is special, so skip-special decoding drops all of them.
    special = list(TINY_ADDED_TOKENS)
    roles = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
             "unk_token": "<unk>"}
    return {
        "vocab.json": vocab,
        "merges.txt": "#version: 0.2\n",
        "added_tokens.json": added,
        "special_tokens_map.json": {**roles, "additional_special_tokens": special},
        "tokenizer_config.json": {
            **roles, "added_tokens_decoder": decoder, "additional_special_tokens": special,
            "bad_token_ids": TINY_BAD_TOKEN_IDS, "tokenizer_class": "MiniCPMOTokenizerFast",
            "model_max_length": 40960, "clean_up_tokenization_spaces": False, "errors": "replace",
            "split_special_tokens": False, "add_prefix_space": False,
        },
    }


def preprocessor_config() -> dict[str, Any]:
    return {"processor_class": "MiniCPMOProcessor", "image_processor_type": "MiniCPMVImageProcessor",
            "max_slice_nums": 9, "scale_resolution": 448, "patch_size": 14, "use_image_id": True,
            "image_feature_size": 64, "im_start": "<image>", "im_end": "</image>", "slice_start": "<slice>",
            "slice_end": "</slice>", "unk": "<unk>", "norm_mean": [0.5, 0.5, 0.5],
            "norm_std": [0.5, 0.5, 0.5], "audio_pool_step": 5, "version": 4.5,
            "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80,
            "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 30,
            "padding_value": 0.0, "return_attention_mask": False}


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    """Chat-mode settings (ignored in duplex); ids come from the tiny tokenizer, not the real file."""
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "temperature": 0.6, "top_k": 20, "top_p": 0.95,
            "do_sample": True, "transformers_version": "4.51.0"}
