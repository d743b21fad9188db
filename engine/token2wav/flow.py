"""`CausalMaskedDiffWithXvec`: token embedding → conformer encoder → μ → CFM with the DiT (§1.6, §6.5).

State-dict keys equal the `flow.pt` keys (§8.4). `decoder.rand_noise` is a non-persistent buffer
drawn from a seeded CPU generator (Q20 fix) and shared read-only by every session. The module holds
no per-session state: caches go in and come out as `FlowCache` values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import allow_recompiles, compile_symbolic
from engine.token2wav.cfm import EstimatorFn, solve_chunk
from engine.token2wav.config import FlowConfig
from engine.token2wav.dit import DiT
from engine.token2wav.encoder import UpsampleConformerEncoder, run_conformer_block

# (embedded tokens, last, cnn cache, att cache) → (h, cnn cache, att cache); a CUDA-graph runner or
# `UpsampleConformerEncoder.forward_chunk` itself.
EncoderFn = Callable[[torch.Tensor, bool, "torch.Tensor | None", "torch.Tensor | None"],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class FlowCache:
    """Streaming caches of one session (B = 1) or of a batch of sessions stacked along B."""

    conformer_cnn: torch.Tensor   # [B, D, 6]
    conformer_att: torch.Tensor   # [Lt + Lm, B, H, T, 2·dk], token-rate layers tiled ×2 along T
    estimator_cnn: torch.Tensor   # [n_ts, depth, 2B, 2C, 2]
    estimator_att: torch.Tensor   # [n_ts, depth, 2B, H, T, 2·hd], newest first

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conformer_cnn, self.conformer_att, self.estimator_cnn, self.estimator_att)

    def clone(self) -> FlowCache:
        return FlowCache(*(t.clone() for t in self.tensors()))

    @property
    def estimator_len(self) -> int:
        return self.estimator_att.shape[4]


class CFMDecoder(nn.Module):
    """Holds the estimator (keys `decoder.estimator.*`) and the fixed noise (not in the state dict)."""

    def __init__(self, cfg: FlowConfig, noise_seed: int) -> None:
        super().__init__()
        self.estimator = DiT(cfg)
        gen = torch.Generator().manual_seed(noise_seed)
        noise = torch.randn([1, cfg.mel_dim, cfg.noise_frames], generator=gen)
        self.register_buffer("rand_noise", noise, persistent=False)


class CausalMaskedDiffWithXvec(nn.Module):
    def __init__(self, cfg: FlowConfig, noise_seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_dim)
        self.encoder = UpsampleConformerEncoder(cfg)
        self.encoder_proj = nn.Linear(cfg.enc_dim, cfg.mel_dim)
        self.decoder = CFMDecoder(cfg, noise_seed)

    def compile_blocks(self) -> None:
        """The conformer's ten blocks and the DiT's sixteen each through one torch.compile'd block (regional
        compilation, dynamic sizes), before any graph is captured: fewer, fused kernels per call."""
        allow_recompiles(16)  # the conformer: with and without history, one row and more, two layouts
        self.encoder.block_fn = compile_symbolic(run_conformer_block)
        self.decoder.estimator.compile_blocks()

    def project_spk(self, spk: torch.Tensor) -> torch.Tensor:
        """CAM++ x-vector [B, 192] → [B, 80] (L2-normalised, then affine)."""
        return self.spk_embed_affine_layer(F.normalize(spk, dim=1))

    def noise(self, offset: int, frames: int) -> torch.Tensor:
        if offset + frames > self.cfg.noise_frames:
            raise ValueError(f"flow noise exhausted: {offset} + {frames} > {self.cfg.noise_frames}")
        return self.decoder.rand_noise[:, :, offset: offset + frames]

    def encode(self, tokens: torch.Tensor, last: bool, cnn: torch.Tensor | None, att: torch.Tensor | None,
               encoder: EncoderFn | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, m] → (μ [B, 80, F], conformer cnn cache, conformer att cache)."""
        enc = encoder if encoder is not None else self.encoder.forward_chunk
        h, new_cnn, new_att = enc(self.input_embedding(tokens), last, cnn, att)
        return self.encoder_proj(h).transpose(1, 2).contiguous(), new_cnn, new_att

    @torch.inference_mode()
    def setup_cache(self, tokens: torch.Tensor, mel: torch.Tensor, spk: torch.Tensor, n_timesteps: int
                    ) -> FlowCache:
        """Base cache of a voice: tokens [1, P_tok + 3] (with look-ahead pad), mel [1, P, 80], spk [1, 192]."""
        cfg = self.cfg
        if (tokens.shape[1] - cfg.pre_lookahead_len) * cfg.up_stride != mel.shape[1]:
            raise ValueError(f"setup: {tokens.shape[1]} tokens do not match {mel.shape[1]} prompt mel frames")
        mu, cnn, att = self.encode(tokens, False, None, None)
        noise = self.noise(0, mu.shape[2]).expand(mu.shape[0], -1, -1)
        _, est_cnn, est_att = solve_chunk(self.decoder.estimator.forward_chunk, noise, mu, self.project_spk(spk),
                                          mel.transpose(1, 2).contiguous(), n_timesteps, cfg.cfg_rate, None, None)
        return FlowCache(cnn, att, est_cnn, est_att)

    @torch.inference_mode()
    def forward_chunk(self, tokens: torch.Tensor, spk_proj: torch.Tensor, cache: FlowCache, last: bool,
                      n_timesteps: int, estimator: EstimatorFn | None = None, encoder: EncoderFn | None = None
                      ) -> tuple[torch.Tensor, FlowCache]:
        """tokens [B, m] (with look-ahead), spk_proj [B, 80] → (mel [B, 80, F], new untrimmed cache).

        Every row of a batch must have the same cache lengths (the noise offset is the shared
        estimator length L: rows read rand_noise[L : L + F]).
        """
        mu, cnn, att = self.encode(tokens, last, cache.conformer_cnn, cache.conformer_att, encoder)
        noise = self.noise(cache.estimator_len, mu.shape[2]).expand(mu.shape[0], -1, -1)
        est = estimator if estimator is not None else self.decoder.estimator.forward_chunk
        mel, est_cnn, est_att = solve_chunk(est, noise, mu, spk_proj, torch.zeros_like(mu), n_timesteps,
                                            self.cfg.cfg_rate, cache.estimator_cnn, cache.estimator_att)
        return mel, FlowCache(cnn, att, est_cnn, est_att)


Flow = CausalMaskedDiffWithXvec
