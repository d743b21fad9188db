"""Builds the Step-Audio2 (minicpmo 0.1.2) reference Token2Wav modules at tiny dims with our weights.

Also holds a line-by-line port of the reference `Token2wav.stream` (which itself needs CUDA, s3tokenizer
and onnx) running on the reference modules: the oracle for our streaming path.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.token2wav.assets import TINY_HIFT, build_tiny_modules, hift_file_state
from engine.token2wav.config import TINY_FLOW

_SITE = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "stepaudio2"
# this interpreter's site-packages, else the project venv's copy (carried to a GPU machine)
_REF_DIR = next((p for p in (Path(sys.prefix) / _SITE, *Path(__file__).resolve().parents[2].glob(
    ".venv/lib/python3*/site-packages/stepaudio2")) if p.is_dir()), Path(sys.prefix) / _SITE)


def ref_module(name: str) -> types.ModuleType:
    if "stepaudio2" not in sys.modules:
        pkg = types.ModuleType("stepaudio2")
        pkg.__path__ = [str(_REF_DIR)]
        sys.modules["stepaudio2"] = pkg
    return importlib.import_module(f"stepaudio2.{name}")


def build_ref_flow(ours: torch.nn.Module) -> torch.nn.Module:
    c = TINY_FLOW
    enc_mod = ref_module("cosyvoice2.transformer.upsample_encoder_v2")
    dit_mod = ref_module("cosyvoice2.flow.decoder_dit")
    cfm_mod = ref_module("cosyvoice2.flow.flow_matching")
    flow_mod = ref_module("cosyvoice2.flow.flow")
    enc = enc_mod.UpsampleConformerEncoderV2(
        input_size=c.input_size, output_size=c.enc_dim, pre_lookahead_len=c.pre_lookahead_len,
        num_blocks=c.enc_blocks, num_up_blocks=c.enc_up_blocks, up_stride=c.up_stride,
        attention_heads=c.enc_heads, linear_units=c.enc_linear_units)
    dit = dit_mod.DiT(in_channels=c.dit_in_channels, out_channels=c.dit_out_channels, mlp_ratio=c.dit_mlp_ratio,
                      depth=c.dit_depth, num_heads=c.dit_heads, head_dim=c.dit_head_dim, hidden_size=c.dit_hidden)
    # The reference scratch buffers are sized for the full model (§6.8 #4): resize them for tiny dims.
    max_t, hd2, c2 = 1000, 2 * c.dit_head_dim, 2 * c.dit_hidden
    dit.att_cache_buffer = torch.zeros(c.dit_depth, 2, c.dit_heads, max_t, hd2)
    dit.cnn_cache_buffer = torch.zeros(c.dit_depth, 2, c2, 2)
    cfm = cfm_mod.CausalConditionalCFM(dit, inference_cfg_rate=c.cfg_rate)
    cfm.att_cache_buffer = torch.zeros(16, c.dit_depth, 2, c.dit_heads, max_t, hd2)
    cfm.cnn_cache_buffer = torch.zeros(16, c.dit_depth, 2, c2, 2)
    flow = flow_mod.CausalMaskedDiffWithXvec(input_size=c.input_size, output_size=c.mel_dim,
                                             spk_embed_dim=c.spk_embed_dim, vocab_size=c.vocab_size,
                                             encoder=enc, decoder=cfm)
    flow.load_state_dict(ours.state_dict(), strict=True)
    flow.decoder.rand_noise = ours.decoder.rand_noise.clone()   # the reference noise is process-global
    return flow.eval()


def build_ref_hift(ours: torch.nn.Module) -> torch.nn.Module:
    hg = ref_module("flashcosyvoice.modules.hifigan")
    ref = hg.HiFTGenerator(base_channels=TINY_HIFT.base_channels,
                           f0_predictor=hg.ConvRNNF0Predictor(cond_channels=TINY_HIFT.f0_cond_channels))
    state = {k.removeprefix("generator."): v for k, v in hift_file_state(ours).items()}
    ref.load_state_dict(state, strict=True)
    return ref.eval()


class RefStreamer:
    """Port of the reference `Token2wav.set_stream_cache` + `stream` (CPU, float output, one session)."""

    def __init__(self, flow, hift, prompt_tokens, prompt_mel, spk, n_timesteps, silence_code):
        self.flow, self.hift, self.n = flow, hift, n_timesteps
        self.p = prompt_mel.shape[0]
        self.spk = spk[None]
        pad = torch.full((1, 3), silence_code, dtype=torch.long)
        self.base = flow.setup_cache(torch.cat([prompt_tokens[None].long(), pad], dim=1),
                                     prompt_mel[None], self.spk, n_timesteps=n_timesteps)
        self.base = {k: v.clone() for k, v in self.base.items()}
        self.window = torch.from_numpy(np.hamming(2 * 3840))
        self.reset()

    def reset(self):
        self.cache = {k: v.clone() for k, v in self.base.items()}
        self.hc = dict(mel=torch.zeros(1, 80, 0), source=torch.zeros(1, 1, 0), speech=torch.zeros(1, 0))

    def stream(self, tokens, last):
        mel, self.cache = self.flow.inference_chunk(torch.tensor([tokens]), self.spk, self.cache, last, self.n)
        self.cache = {k: v.clone() for k, v in self.cache.items()}   # the port clones scratch views (§6.8)
        if self.cache["estimator_att_cache"].shape[4] > self.p + 100:
            a = self.cache["estimator_att_cache"]
            self.cache["estimator_att_cache"] = torch.cat([a[:, :, :, :, :self.p], a[:, :, :, :, -100:]], dim=4)
        if self.cache["conformer_att_cache"].shape[3] > self.p + 100:
            a = self.cache["conformer_att_cache"]
            self.cache["conformer_att_cache"] = torch.cat([a[:, :, :, :self.p, :], a[:, :, :, -100:, :]], dim=3)
        mel = torch.concat([self.hc["mel"], mel], dim=2)
        speech, source = self.hift(mel, self.hc["source"])
        cached = self.hc["speech"]
        if cached.shape[-1] > 0:
            speech = speech.clone()
            speech[..., :3840] = speech[..., :3840] * self.window[:3840] + cached[..., -3840:] * self.window[3840:]
        first = cached.shape[-1] == 0
        self.hc = dict(mel=mel[..., -8:].clone(), source=source[:, :, -3840:].clone(),
                       speech=speech[:, -3840:].clone())
        if not last:
            speech = torch.cat([torch.zeros(1, 3840), speech[:, :-3840]], dim=1) if first else speech[:, :-3840]
        pcm = (np.clip(speech.numpy(), -1.0, 1.0) * 32767.0).astype("<i2")
        return pcm[0]


def enlarge_flow_(flow: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    """std 0.02 weights give tiny activations that would hide a wrong term or cache: enlarge them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in flow.named_parameters():
            if "pos_bias" in name:
                p.normal_(0, 1.0, generator=gen)
            elif p.dim() >= 2 and "input_embedding" not in name:
                p.mul_(8.0)
    return flow


@pytest.fixture(scope="module")
def tiny_pair():
    flow, hift = build_tiny_modules(seed=0)
    return flow.eval(), hift.eval()


def test_reference_builds(tiny_pair):
    flow, hift = tiny_pair
    assert build_ref_flow(flow) is not None and build_ref_hift(hift) is not None
