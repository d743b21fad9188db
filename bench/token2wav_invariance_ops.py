"""Which part of the Token2Wav makes a session's audio depend on its batch? (issue 16, Token2Wav half)

bench/token2wav_batch_invariance.py showed that on the H200 a session's PCM rendered among 2-32 others differs from
its PCM alone by up to 1 LSB (float16 and float32 flow, graphs or not, cuDNN on or off). This runs the Token2Wav's
parts one by one, eager, on random weights (bench_token2wav.build_models) and random inputs of one steady-state
call (28 codes -> 50 mel frames, a 10 s prompt, the pool's fixed graph widths), row 0's input the same at every row
count n, and says per part and n whether session 0's output equals its output alone (n = 1), bit for bit:
  - the flow's conformer encoder as the engine calls it (`encode_ragged`): mu and the new caches;
  - one DiT estimator call (`DiT.forward_ragged`, CFG rows [cond 0..n-1; uncond 0..n-1]) and the 5-step solve
    (`solve_ragged`): session 0's cond and uncond velocities, its mel;
  - HiFT: the f0 predictor, the NSF source (rand_ini / noise are per-row inputs, as `draw_nsf` makes them), the
    source STFT, the iSTFT, decode (mel + source -> wav) and the whole forward;
  - single layers on [n, ...] rows ([2n, ...] in the DiT, CFG): the encoder's Linears / Conv1ds, DiT block 0's
    Linears, causal Conv1ds and masked SDPA, the t_embedder, HiFT's C->1 / 9->1 Linears and first upsampling stage.
HiFT runs in float32, so its convs take TF32 through cuDNN unless --no-tf32 (PyTorch allows it by default).
Run on the H200 (host Python with torch), from the repository root:
    python bench/token2wav_invariance_ops.py --json out16.json        # float16 flow, as the h200 profiles serve
    python bench/token2wav_invariance_ops.py --flow-dtype fp32 --no-tf32 --json out32.json
    python bench/token2wav_invariance_ops.py --no-cudnn --json nocudnn.json
CPU smoke test (tiny dims, fp32): python bench/token2wav_invariance_ops.py --tiny; on the CPU oneDNN's convs and MKL's
small GEMMs are not bit-invariant either, so a CPU table shows float32-rounding differences too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_token2wav import build_models  # noqa: E402
from engine.token2wav.assets import Token2WavModels  # noqa: E402
from engine.token2wav.cfm import cosine_t_span, euler_steps, solve_ragged  # noqa: E402
from engine.token2wav.config import StreamConfig  # noqa: E402
from engine.token2wav.pool import PoolConfig  # noqa: E402
from engine.token2wav.ragged import encode_ragged, round_up  # noqa: E402

PROMPT_FRAMES = 500       # P: a 10 s voice prompt, the pool's cap
TINY_PROMPT_FRAMES = 40


@dataclass(frozen=True)
class Call:
    """One steady-state call of a session at the engine's fixed graph widths (pool.py, pooled.py)."""

    codes: int         # token input width (chunk_call, a multiple of the token bucket)
    frames: int        # new mel frames F
    est_hist: int      # estimator history after the §6.5 trims (P + keep); the new frames follow it
    tg: int            # estimator window (FlowPool.est_width)
    tok_width: int     # gathered conformer histories (FlowPool.tok_width / mel_width)
    mel_width: int
    hift_frames: int   # HiFT mel input: the 8 cached frames + F
    source: int        # HiFT cached source samples


def steady_call(models: Token2WavModels, scfg: StreamConfig, prompt: int) -> Call:
    fcfg, bucket = models.flow_cfg, PoolConfig().cache_bucket
    mel_cap = prompt + scfg.cache_keep_frames + fcfg.up_stride * scfg.chunk_call   # as FlowPool
    frames = fcfg.up_stride * scfg.chunk_new
    return Call(scfg.chunk_call, frames, prompt + scfg.cache_keep_frames, round_up(mel_cap + 1, bucket),
                round_up(mel_cap // fcfg.up_stride + 1, bucket), round_up(mel_cap, bucket),
                scfg.mel_cache_frames + frames, scfg.mel_cache_frames * models.hift_cfg.samples_per_frame)


def compare(name: str, fn: Callable[[int], torch.Tensor], ns: list[int]) -> dict:
    """fn(n) -> session 0's output among n sessions; '=' or max |diff| against fn(1), session 0 alone."""
    alone = fn(1).clone()
    cells = {}
    for n in ns:
        got = fn(n)
        cells[str(n)] = "=" if torch.equal(got, alone) else f"{float((got.float() - alone.float()).abs().max()):.2g}"
    return dict(part=name, cells=cells)


def head(t: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """The first n rows along `dim`, contiguous (the engine's batch tensors are fresh gathers / cats)."""
    return t.narrow(dim, 0, n).contiguous()


class Inputs:
    """Random per-session inputs for `top` sessions, drawn on the CPU once; a batch of n takes sessions 0..n-1."""

    def __init__(self, seed: int, dev: torch.device) -> None:
        self.gen, self.dev = torch.Generator().manual_seed(seed), dev

    def randn(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.dev, dtype)


def flow_rows(models: Token2WavModels, call: Call, scfg: StreamConfig, ns: list[int], dev: torch.device
              ) -> list[dict]:
    cfg, flow, dit = models.flow_cfg, models.flow, models.flow.decoder.estimator
    dtype, top, la, f = next(flow.parameters()).dtype, max(ns), cfg.pre_lookahead_len, call.frames
    r = Inputs(21, dev)
    # encoder: tokens [B, 28], histories [L, B, H, C, 2dk] left-padded (valid frames at the end)
    tokens = torch.randint(0, cfg.vocab_size, (top, call.codes), generator=r.gen).to(dev)
    m = torch.full((top,), call.codes, device=dev)
    cnn = r.randn(top, cfg.enc_dim, cfg.enc_cnn_cache_len, dtype=dtype)
    dk2 = 2 * cfg.enc_dim // cfg.enc_heads
    tok_kv = r.randn(cfg.enc_blocks, top, cfg.enc_heads, call.tok_width, dk2, dtype=dtype)
    mel_kv = r.randn(cfg.enc_up_blocks, top, cfg.enc_heads, call.mel_width, dk2, dtype=dtype)
    valid = lambda width, hist: (torch.arange(width, device=dev) >= width - hist)[None].expand(top, -1)  # noqa: E731
    tok_mask, mel_mask = valid(call.tok_width, call.est_hist // cfg.up_stride), valid(call.mel_width, call.est_hist)

    def encoder(n: int) -> torch.Tensor:
        mu, new_cnn, new_tok, new_mel = encode_ragged(
            flow, tokens[:n], m[:n], m[:n] - la, cnn[:n], head(tok_kv, n, 1), tok_mask[:n], head(mel_kv, n, 1),
            mel_mask[:n])
        return torch.cat([mu[0].flatten(), new_cnn[0].flatten(), new_tok[:, 0].flatten(), new_mel[:, 0].flatten()])

    # estimator: x, mu [B, 80, F], spks [B, 80]; caches per CFG pair [depth, 2, B, ...] → rows [cond; uncond]
    x, mu = r.randn(top, cfg.mel_dim, f, dtype=dtype), r.randn(top, cfg.mel_dim, f, dtype=dtype)
    spks = r.randn(top, cfg.mel_dim, dtype=dtype)
    est_cnn = r.randn(cfg.dit_depth, 2, top, 2 * cfg.dit_hidden, cfg.dit_conv_kernel - 1, dtype=dtype)
    kv = r.randn(cfg.dit_depth, 2, top, cfg.dit_heads, call.tg, 2 * cfg.dit_head_dim, dtype=dtype)
    key_mask = (torch.arange(call.tg, device=dev) < call.est_hist + f)[None].expand(top, -1)   # history + new
    wpos = (call.est_hist + torch.arange(f, device=dev))[None].expand(top, -1)                # new frames' columns
    cnn_end = (f + torch.arange(cfg.dit_conv_kernel - 1, device=dev))[None].expand(top, -1)
    steps = euler_steps(cosine_t_span(scfg.n_timesteps, dev, dtype))
    pair = lambda t, n: torch.cat([t[:, 0, :n], t[:, 1, :n]], dim=1)  # noqa: E731  fresh [depth, 2n, ...]
    two = lambda t, n: torch.cat([t[:n], t[:n]], dim=0)  # noqa: E731
    zero = lambda t, n: torch.cat([t[:n], torch.zeros_like(t[:n])], dim=0)  # noqa: E731  uncond: mu, spks = 0

    def estimator(n: int) -> torch.Tensor:
        v, _ = dit.forward_ragged(two(x, n), zero(mu, n), steps[2][0].expand(2 * n), zero(spks, n),
                                  torch.zeros(2 * n, cfg.mel_dim, f, device=dev, dtype=dtype), pair(est_cnn, n),
                                  pair(kv, n), two(key_mask, n), two(wpos, n), two(cnn_end, n))
        return v[[0, n]]

    def solve(n: int) -> torch.Tensor:
        cnn_steps = pair(est_cnn, n)[None].expand(scfg.n_timesteps, *[-1] * 4).contiguous()
        window = lambda step: pair(kv, n)  # noqa: E731  one random window serves every step; store drops it
        mel, _ = solve_ragged(dit.forward_ragged, x[:n], mu[:n], spks[:n], scfg.n_timesteps, cfg.cfg_rate, cnn_steps,
                              window, two(key_mask, n), two(wpos, n), two(cnn_end, n), lambda step, w: None)
        return mel[0]

    enc, e, tq = flow.encoder, cfg.enc_dim, call.codes - la
    layers = [("embed Linear", enc.embed.out[0], (call.codes, e)),
              ("pre-lookahead conv1 (Conv1d k4)", enc.pre_lookahead_layer.conv1, (e, call.codes)),
              ("pre-lookahead conv2 (Conv1d k3)", enc.pre_lookahead_layer.conv2, (e, tq + 2)),
              ("block 0 linear_q", enc.encoders[0].self_attn.linear_q, (tq, e)),
              ("block 0 ffn w_1", enc.encoders[0].feed_forward.w_1, (tq, e)),
              ("block 0 ffn w_2", enc.encoders[0].feed_forward.w_2, (tq, cfg.enc_linear_units)),
              ("upsample conv (Conv1d k5)", enc.up_layer.conv, (e, cfg.up_stride * tq + cfg.enc_cnn_cache_len - 2)),
              ("up block 0 linear_q", enc.up_encoders[0].self_attn.linear_q, (cfg.up_stride * tq, e))]
    rows = [compare("flow encoder (encode_ragged): mu + caches", encoder, ns),
            *layer_rows("encoder", layers, 1, ns, r, dtype),
            compare("DiT estimator, one call (forward_ragged)", estimator, ns),
            compare(f"flow solve, {scfg.n_timesteps} Euler steps (solve_ragged)", solve, ns)]
    # DiT block 0's layers on [2n, ...] (CFG rows), and its masked attention core
    blk, hd = dit.blocks[0], cfg.dit_head_dim
    d, hid = cfg.dit_hidden, int(cfg.dit_hidden * cfg.dit_mlp_ratio)
    layers = [("in_proj", dit.in_proj, (f, cfg.dit_in_channels)), ("adaLN Linear", blk.adaLN_modulation[1], (1, d)),
              ("to_q", blk.attn.to_q, (f, d)), ("to_k", blk.attn.to_k, (f, d)), ("to_v", blk.attn.to_v, (f, d)),
              ("attn proj", blk.attn.proj, (f, d)), ("conv 1 (Conv1d k3)", blk.conv.block[1], (d, f + 2)),
              ("conv 2 (Conv1d k3)", blk.conv.block[6], (d, f + 2)), ("mlp fc1", blk.mlp["fc1"], (f, d)),
              ("mlp fc2", blk.mlp["fc2"], (f, hid)), ("final Linear", dit.final_layer.linear, (f, d))]
    rows += layer_rows("DiT block 0", layers, 2, ns, r, dtype)
    q = r.randn(2 * top, cfg.dit_heads, f, hd, dtype=dtype)
    mask = torch.cat([key_mask, key_mask])[:, None, None, :]

    def sdpa(n: int) -> torch.Tensor:
        window = pair(kv, n)[0]                                                    # [2n, H, tg, 2hd]
        return F.scaled_dot_product_attention(q[:2 * n], window[..., :hd], window[..., hd:],
                                              attn_mask=head(mask, 2 * n))[0]
    rows.append(compare("DiT block 0 SDPA (key mask)", sdpa, ns))
    t_mlp = dit.t_embedder.mlp          # Linears on [2n, C]: the GEMM's M is the row count itself
    return rows + layer_rows("DiT t_embedder", [("fc1", t_mlp[0], (cfg.t_freq_dim,)), ("fc2", t_mlp[2], (d,))],
                             2, ns, r, dtype)


def layer_rows(prefix: str, layers: list[tuple[str, torch.nn.Module, tuple[int, ...]]], per_session: int,
               ns: list[int], r: Inputs, dtype: torch.dtype) -> list[dict]:
    """Each layer on [per_session · n, *shape] random rows, row 0 fixed."""
    rows = []
    for name, mod, shape in layers:
        x = r.randn(per_session * max(ns), *shape, dtype=dtype)
        rows.append(compare(f"{prefix} {name}", lambda n, mod=mod, x=x: mod(head(x, per_session * n))[0], ns))
    return rows


def hift_rows(models: Token2WavModels, call: Call, ns: list[int], dev: torch.device) -> list[dict]:
    hift, hcfg, top, r = models.hift, models.hift_cfg, max(ns), Inputs(31, dev)
    t, k = call.hift_frames, hcfg.nb_harmonics + 1
    length = t * hcfg.samples_per_frame
    fp32, frames = torch.float32, length // hcfg.istft_hop + 1                 # STFT frames of the source
    mel, src = r.randn(top, hcfg.in_channels, t, dtype=fp32), r.randn(top, 1, call.source, dtype=fp32)
    ini = torch.rand(top, k, generator=r.gen).to(dev)       # the NSF draws are inputs (draw_nsf), per row
    noise = r.randn(top, length, k, dtype=fp32)
    spec = torch.complex(r.randn(top, hcfg.istft_n_fft // 2 + 1, frames, dtype=fp32),
                         r.randn(top, hcfg.istft_n_fft // 2 + 1, frames, dtype=fp32))
    f0 = F.interpolate(hift.f0_predictor(mel)[:, None], scale_factor=float(hcfg.samples_per_frame)).transpose(1, 2)
    source = hift.m_source(f0, ini, noise).transpose(1, 2)                     # [B, 1, L]
    rows = [compare("HiFT f0 predictor", lambda n: hift.f0_predictor(mel[:n])[0], ns),
            compare("HiFT NSF source (fixed rand_ini, noise)",
                    lambda n: hift.m_source(f0[:n], ini[:n], noise[:n])[0], ns),
            compare("HiFT source STFT", lambda n: hift._stft(source[:n, 0])[0], ns),
            compare("HiFT iSTFT (irfft + fold)", lambda n: hift._istft(spec[:n])[0], ns),
            compare("HiFT decode (mel + source -> wav)", lambda n: hift.decode(mel[:n], source[:n])[0], ns),
            compare("HiFT forward (mel -> wav)", lambda n: hift(mel[:n], src[:n], ini[:n], noise[:n])[0][0], ns)]
    # the f0 / source Linears (N = 1: GEMVs), then the first upsampling stage: conv_pre, ups[0], source branch,
    # resblocks
    base, up = hcfg.base_channels, hcfg.upsample_rates[0]
    layers = [("f0 classifier (Linear C->1)", hift.f0_predictor.classifier, (t, hcfg.f0_cond_channels)),
              ("NSF l_linear (Linear 9->1)", hift.m_source.l_linear, (length, k)),
              ("stage 0 conv_pre (Conv1d k7)", hift.conv_pre, (hcfg.in_channels, t)),
              ("stage 0 ups[0] (ConvTranspose1d)", hift.ups[0], (base, t)),
              ("stage 0 source_downs[0] (Conv1d)", hift.source_downs[0], (hcfg.istft_n_fft + 2, frames)),
              ("stage 0 source_resblocks[0] convs1[0]", hift.source_resblocks[0].convs1[0], (base // 2, up * t))]
    layers += [(f"stage 0 resblocks[0] convs1[{i}] (dilation {hcfg.resblock_dilations[i]})", c, (base // 2, up * t))
               for i, c in enumerate(hift.resblocks[0].convs1)]
    layers += [(f"stage 0 resblocks[{j}] convs1[0] (k{hcfg.resblock_kernel_sizes[j]})", hift.resblocks[j].convs1[0],
                (base // 2, up * t)) for j in range(1, len(hcfg.resblock_kernel_sizes))]
    return rows + layer_rows("HiFT", layers, 1, ns, r, fp32)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (smoke test)")
    ap.add_argument("--counts", default="2,4,8,16,32", help="sessions per batch, compared with 1, comma separated")
    ap.add_argument("--flow-dtype", choices=("fp32", "fp16"), default=None, help="default: fp16 on CUDA")
    ap.add_argument("--no-cudnn", action="store_true", help="torch.backends.cudnn.enabled = False")
    ap.add_argument("--no-tf32", action="store_true", help="no TF32 in the float32 cuDNN convs (HiFT)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    flow_dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.flow_dtype or (
        "fp16" if dev.type == "cuda" else "fp32")]
    torch.backends.cudnn.enabled = not args.no_cudnn
    torch.backends.cudnn.allow_tf32 = not args.no_tf32
    ns = [int(c) for c in args.counts.split(",") if c]
    models, scfg = build_models(args.tiny, dev, flow_dtype), StreamConfig()
    call = steady_call(models, scfg, TINY_PROMPT_FRAMES if args.tiny else PROMPT_FRAMES)
    with torch.inference_mode():
        rows = flow_rows(models, call, scfg, ns, dev) + hift_rows(models, call, ns, dev)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    flags = dict(cudnn=torch.backends.cudnn.enabled, cudnn_tf32=torch.backends.cudnn.allow_tf32,
                 matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
                 fp16_reduced_reduction=torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
    print(f"session 0 among n sessions vs alone ({device}, flow {flow_dtype}, HiFT float32, {flags}, {call}): "
          "'=' bit-equal, else max |diff|")
    print(f"{'part':52s} " + " ".join(f"{n:>7d}" for n in ns))
    for r in rows:
        print(f"{r['part']:52s} " + " ".join(f"{r['cells'][str(n)]:>7s}" for n in ns))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, flow_dtype=str(flow_dtype), counts=ns, **flags,
                                                   call=call.__dict__, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
