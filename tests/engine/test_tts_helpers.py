"""Shared fixtures for the TTS tests: tiny config (model.md §9.2), seeded weights, an HF Llama oracle
and an independent scalar re-statement of §5.3/§5.4 sampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel

from engine.config import TTSConfig
from engine.model.tts import TTSModel
from engine.weights import init_module_

TINY = dict(llm_dim=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
            num_audio_tokens=6562, num_text_tokens=320, audio_bos_token_id=317, text_eos_token_id=318)


def tiny_cfg() -> TTSConfig:
    return TTSConfig(**TINY)


def tiny_model(seed: int = 0) -> TTSModel:
    model = TTSModel(tiny_cfg())
    init_module_(model, torch.Generator().manual_seed(seed))
    return model.eval()


def hf_backbone(model: TTSModel) -> LlamaModel:
    """transformers LlamaModel with the same dims, weights copied by key (`model.` prefix dropped)."""
    c = model.cfg
    hf_cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, vocab_size=32000, attn_implementation="eager")
    hf = LlamaModel(hf_cfg).eval()
    ours = {k[len("model."):]: v for k, v in model.state_dict().items() if k.startswith("model.")}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    assert unexpected == [] and missing == ["embed_tokens.weight"]
    return hf


def offline_condition(model: TTSModel, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """§5.1 from the raw state dict: [n + 1, H]."""
    sd = model.state_dict()
    p = F.linear(F.relu(F.linear(hidden, sd["projector_semantic.linear1.weight"],
                                 sd["projector_semantic.linear1.bias"])),
                 sd["projector_semantic.linear2.weight"], sd["projector_semantic.linear2.bias"])
    p = p / p.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    rows = sd["emb_text.weight"][torch.tensor(ids, dtype=torch.int64)] + p
    bos = sd["emb_text.weight"][model.cfg.audio_bos_token_id][None]
    return torch.cat([rows, bos])


def ref_sample(logits: list[float] | torch.Tensor, history: list[int], allow_eos: bool, u: float,
               eos: int, temperature: float = 0.8, penalty: float = 1.05, window: int = 16) -> int:
    """One step of §5.4 written plainly, one row at a time."""
    s = torch.as_tensor(logits, dtype=torch.float32) / temperature
    recent = history[-window:]
    for code in set(recent):
        a = torch.pow(torch.tensor(penalty), torch.tensor(recent.count(code))).float()
        s[code] = s[code] * a if s[code] < 0 else s[code] / a
    if not allow_eos:
        s[eos] = float("-inf")
    p = torch.softmax(s, -1)
    cdf = p.cumsum(0)
    target = torch.tensor(u, dtype=torch.float64).float() * cdf[-1]
    above = (cdf > target).nonzero()
    return int(above[0]) if len(above) else int((p > 0).nonzero()[-1])


class OracleSession:
    """The reference generate_chunk loop over an HF LlamaModel with a DynamicCache."""

    def __init__(self, model: TTSModel, seed: int, eos_bias: float = 0.0) -> None:
        from transformers import DynamicCache
        self.model, self.hf = model, hf_backbone(model)
        self.cache_cls = DynamicCache
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.eos, self.eos_bias = model.cfg.eos_code, eos_bias
        self.cache, self.pos = DynamicCache(), 0

    def _forward(self, embeds: torch.Tensor) -> torch.Tensor:
        n = embeds.shape[0]
        pos = torch.arange(self.pos, self.pos + n)[None]
        out = self.hf(inputs_embeds=embeds[None], position_ids=pos, past_key_values=self.cache,
                      use_cache=True)
        self.pos += n
        logits = F.linear(out.last_hidden_state[0, -1], self.model.head_code[0].weight).float()
        logits[self.eos] += self.eos_bias
        return logits

    @torch.no_grad()
    def unit(self, ids: list[int], hidden: torch.Tensor, end_of_turn: bool) -> list[int]:
        allow_eos = self.pos == 0 or end_of_turn
        logits = self._forward(offline_condition(self.model, ids, hidden))
        codes: list[int] = []
        for t in range(26):
            u = float(torch.rand(1, dtype=torch.float64, generator=self.gen))
            code = ref_sample(logits, codes, allow_eos, u, self.eos)
            if code == self.eos or t == 25:
                break
            codes.append(code)
            logits = self._forward(self.model.emb_code[0].weight[code][None])
        if end_of_turn:
            self.cache, self.pos = self.cache_cls(), 0
        return codes


def with_eos_bias(model: TTSModel, bias: float) -> TTSModel:
    """Make EOS likely (random weights give ≈ 1/6562): logits get `bias` on the EOS column."""
    base = TTSModel.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = base(model, hidden)
        out[..., model.cfg.eos_code] += bias
        return out

    model.logits = logits  # type: ignore[method-assign]
    return model
