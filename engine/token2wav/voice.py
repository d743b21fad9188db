"""Voice pack input (§8.6) and the per-voice immutable base cache (§6.2).

The voice-pack *file* loader lives elsewhere; here a pack is a dataclass (or a dict of tensors).
The base cache is built once per voice and never written: every turn takes a clone (§6.3, §6.8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.token2wav.config import StreamConfig
from engine.token2wav.flow import Flow, FlowCache


class VoiceError(ValueError):
    """A voice pack has missing fields, wrong shapes or out-of-range codes."""


@dataclass(frozen=True)
class VoicePack:
    prompt_tokens: torch.Tensor        # int32 [P_tok]
    spk_embedding: torch.Tensor        # fp32 [192]
    prompt_mel: torch.Tensor           # fp32 [2·P_tok, 80]
    ref_audio_16k: torch.Tensor | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> VoicePack:
        try:
            return cls(data["prompt_tokens"], data["spk_embedding"], data["prompt_mel"], data.get("ref_audio_16k"))
        except KeyError as exc:
            raise VoiceError(f"voice pack: missing tensor {exc}") from exc

    def validate(self, flow: Flow) -> None:
        cfg = flow.cfg
        toks, spk, mel = self.prompt_tokens, self.spk_embedding, self.prompt_mel
        if toks.dim() != 1 or toks.numel() == 0 or toks.is_floating_point():
            raise VoiceError(f"prompt_tokens: want a non-empty int vector, got {tuple(toks.shape)} {toks.dtype}")
        if int(toks.min()) < 0 or int(toks.max()) >= cfg.vocab_size:
            raise VoiceError(f"prompt_tokens: codes must be in [0, {cfg.vocab_size})")
        if tuple(spk.shape) != (cfg.spk_embed_dim,):
            raise VoiceError(f"spk_embedding: want [{cfg.spk_embed_dim}], got {tuple(spk.shape)}")
        want = (toks.numel() * cfg.up_stride, cfg.mel_dim)
        if tuple(mel.shape) != want:
            raise VoiceError(f"prompt_mel: want {list(want)}, got {list(mel.shape)}")


@dataclass(frozen=True)
class VoiceCache:
    """Everything a turn needs from its voice; read-only, shareable by all sessions of that voice."""

    prompt_frames: int                 # P
    spk_proj: torch.Tensor             # [1, 80] projected speaker embedding
    flow: FlowCache                    # base streaming caches (B = 1)
    n_timesteps: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.spk_proj, *self.flow.tensors())


def build_voice_cache(flow: Flow, voice: VoicePack | Mapping[str, Any] | Any, scfg: StreamConfig) -> VoiceCache:
    """Run the flow once on prompt + 3 pad codes with the prompt mel as cond (§6.2)."""
    if isinstance(voice, VoicePack):
        pack = voice
    elif isinstance(voice, Mapping):
        pack = VoicePack.from_mapping(voice)
    else:   # any object with the §8.6 tensor attributes (e.g. engine.voice.VoicePack)
        pack = VoicePack(voice.prompt_tokens, voice.spk_embedding, voice.prompt_mel,
                         getattr(voice, "ref_audio_16k", None))
    pack.validate(flow)
    dev, dtype = flow.spk_embed_affine_layer.weight.device, flow.spk_embed_affine_layer.weight.dtype
    toks = pack.prompt_tokens.to(dev, torch.long)
    n_pad = flow.cfg.pre_lookahead_len
    # layout A pads with silence codes; layout B (1.0.7) with the prompt's first codes (§6.10)
    pad = toks[:n_pad] if scfg.prompt_pad == "prompt_head" else toks.new_full((n_pad,), scfg.silence_code)
    if pad.numel() < n_pad:
        raise VoiceError("prompt_tokens: too short for the prompt_head pad")
    spk = pack.spk_embedding.to(dev, dtype)[None]
    mel = pack.prompt_mel.to(dev, dtype)[None]
    with torch.inference_mode():
        cache = flow.setup_cache(torch.cat([toks, pad])[None], mel, spk, scfg.n_timesteps)
        spk_proj = flow.project_spk(spk)
    return VoiceCache(prompt_frames=mel.shape[1], spk_proj=spk_proj, flow=cache, n_timesteps=scfg.n_timesteps)
