"""Shared fixtures for the Stage0 tests: the tiny byte-level tokenizer of model.md §9.3 and a tiny LLM."""

from __future__ import annotations

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from engine.config import LLMConfig
from engine.model.llm import Qwen3LLM
from engine.stage0.config import SpecialIds
from engine.stage0.textio import TokenizersAdapter

ADDED = ("<|endoftext|> <unk> <|im_end|> <|im_start|> <|listen|> <|speak|> </unit> <unit> <|chunk_eos|> "
         "<|turn_eos|> <|tts_bos|> <|tts_eos|> <|chunk_tts_eos|> <|tts_pad|> <|audio_end|> <|audio|> "
         "<|audio_start|> </image> <image> </slice> <slice> <think> </think> <|interrupt|> <|turn_bos|> "
         "<|chunk_bos|> <|chunk_tts_bos|> <|spk_bos|> <|spk|> <|spk_eos|>").split()
BAD_IDS = (0, 1, 2)

TINY = LLMConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6)


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiny_tokenizer() -> TokenizersAdapter:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ADDED])
    return TokenizersAdapter(tok, BAD_IDS)


def tiny_ids() -> SpecialIds:
    return SpecialIds.from_tokenizer(tiny_tokenizer(), TINY.vocab_size)


def tiny_llm(seed: int = 0, layers: int | None = None) -> Qwen3LLM:
    cfg = TINY if layers is None else LLMConfig(**{**TINY.__dict__, "num_hidden_layers": layers})
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3LLM(cfg).eval()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if not name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


class FakeFrontEnd:
    """Fabricated encoders: a fixed random projection of the unit's PCM (deterministic per input).

    The state records every embedding it produced so tests can rebuild the fed sequence offline.
    """

    def __init__(self, hidden: int = 128, per_unit: int = 10, seed: int = 5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.per_unit = per_unit
        self.proj = torch.randn(1600, hidden, generator=g) * 0.05  # 16,000 samples → 10 × 1600
        self.frame_proj = torch.randn(64, hidden, generator=g)

    def new_state(self) -> dict:
        return {"units": {}}

    def encode_unit(self, state: dict, pcm: torch.Tensor, unit_index: int) -> torch.Tensor:
        emb = pcm[-16000:].reshape(10, 1600).float() @ self.proj  # [10, H]
        state["units"][unit_index] = emb[: self.per_unit]
        return emb[: self.per_unit]

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        n = pcm.shape[0] // 1600
        return pcm[: n * 1600].reshape(n, 1600).float() @ self.proj

    def encode_frame(self, frame: torch.Tensor) -> torch.Tensor:
        return frame.float()[:, None] * self.frame_proj  # [64, H]


def unit_pcm(seed: int, index: int) -> torch.Tensor:
    n = 16480 if index == 0 else 16000
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + index))
