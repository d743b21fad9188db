"""The Stage0 audio front end at full size for bench_stage0.py (issue 15, target: <= 15 ms for 64 units).

One timed call = `AudioFrontEnd.encode_units` for N sessions: push each session's 1 s of PCM, one batched
log-mel over every session's window (up to 30 s each, on the device), the streaming Whisper-medium encoder
over the N units against each session's audio KV (up to 1500 frames), the projector and the pool -> N x
[10, 4096]. The sessions are first streamed to `start_unit` (default 24: 25 s windows, 1200 cached
frames, the expensive end of a session's 30 s cycle), then the next `iters` units are timed, which
cross the 30 s window slide and the audio-KV reset (unit 29) like a long session does.
Weights are dummy N(0, 0.02) (model.md §9.5); the front end's cost does not depend on their values.
"""

from __future__ import annotations

import time

import torch

from engine.audio import AudioFrontEnd, StreamConfig
from engine.config import AudioConfig
from engine.model.audio import AudioProjector, WhisperEncoder

# model.md §1.3: Whisper-medium with the 1500-frame (30 s) position table; projector 1024 -> 4096
FULL_AUDIO = AudioConfig(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                         num_mel_bins=80, max_source_positions=1500)
TINY_AUDIO = AudioConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256,
                         num_mel_bins=80, max_source_positions=1500)
WEIGHT_STD = 0.02
PCM_STD = 0.1


def build_frontend(cfg: AudioConfig, llm_hidden: int, dev: torch.device, dtype: torch.dtype) -> AudioFrontEnd:
    torch.manual_seed(0)
    with torch.device(dev):
        enc = WhisperEncoder(cfg).to(dtype).eval()
        proj = AudioProjector(cfg.d_model, llm_hidden).to(dtype).eval()
    with torch.no_grad():
        for name, p in [*enc.named_parameters(), *proj.named_parameters()]:
            p.fill_(1.0) if "norm" in name and name.endswith("weight") else p.normal_(0.0, WEIGHT_STD)
    return AudioFrontEnd(enc, proj, cfg, mel_device=dev)


def _pcm(unit: int, n: int, dev: torch.device) -> list[torch.Tensor]:
    cfg = StreamConfig()
    samples = cfg.first_chunk_samples - cfg.prefix_zeros if unit == 0 else cfg.chunk_samples
    return [torch.randn(samples, device=dev) * PCM_STD for _ in range(n)]


def bench_frontend(fe: AudioFrontEnd, n: int, start_unit: int, iters: int, dev: torch.device) -> dict:
    """Median / p99 ms of one `encode_units` call for `n` sessions, and what the timed units covered."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    states = [fe.new_session() for _ in range(n)]
    for unit in range(start_unit):
        fe.encode_units(states, _pcm(unit, n, dev))
    samples, slides, resets = [], 0, 0
    for unit in range(start_unit, start_unit + iters):
        pcm = _pcm(unit, n, dev)  # made before the clock starts: the client's PCM is already on the device
        base, reset_count = states[0].mel.base_sample, states[0].kv.resets
        sync()
        t0 = time.perf_counter()
        fe.encode_units(states, pcm)
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
        slides += states[0].mel.base_sample != base
        resets += states[0].kv.resets != reset_count
    samples.sort()
    median = samples[len(samples) // 2]
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return dict(name="front end: log-mel + Whisper + projector", batch=n, ctx=start_unit, ms=(median, p99),
                units=f"{start_unit}..{start_unit + iters - 1}", slides=slides, resets=resets)
