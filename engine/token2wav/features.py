"""Feature extraction for a voice prompt built from a clip (model.md §6.1), in torch, no torchaudio.

Each function follows what the reference (Step-Audio2 `Token2wav._prepare_prompt`, T2W-0.1.2) calls:

| function | reference | used for |
| --- | --- | --- |
| `tokenizer_mel` | `s3tokenizer.log_mel_spectrogram` (Whisper, 128 bins, dynamic floor) | S3 tokenizer input |
| `kaldi_fbank` | `torchaudio.compliance.kaldi.fbank(num_mel_bins=80, dither=0)` | CAM++ input |
| `resample` | `torchaudio.transforms.Resample` (Hann-windowed sinc, width 6, rolloff 0.99) | 16 kHz -> 24 kHz |
| `flow_mel` | `flashcosyvoice.utils.audio.mel_spectrogram` (the HiFT mel of §1.7) | the prompt mel |
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from engine.audio.mel import FloorMode, LogMel, MelConfig, slaney_mel_filters

TOKENIZER_MEL = MelConfig(n_mels=128)  # Whisper defaults otherwise: n_fft 400, hop 160, floor max - 8
# §1.7: 24 kHz, n_fft 1920, hop 480, Slaney mel 0-8000 Hz, 80 bins
FLOW_MEL = MelConfig(sample_rate=24_000, n_fft=1920, hop_length=480, n_mels=80, f_max=8_000.0)
FLOW_MEL_EPS = 1e-9  # magnitude = sqrt(re^2 + im^2 + eps)
FLOW_LOG_CLAMP = 1e-5
# Kaldi fbank defaults (torchaudio.compliance.kaldi), 16 kHz
FBANK_BINS = 80
FRAME_LEN, FRAME_SHIFT, FFT_LEN = 400, 160, 512  # 25 ms, 10 ms, next power of two
PREEMPHASIS = 0.97
POVEY_POWER = 0.85
FBANK_LOW_HZ = 20.0
KALDI_EPS = torch.finfo(torch.float32).eps
# torchaudio Resample defaults
SINC_WIDTH = 6
ROLLOFF = 0.99


def tokenizer_mel(pcm16k: torch.Tensor) -> torch.Tensor:
    """[N] 16 kHz -> [128, N // 160] Whisper log-mel with the dynamic floor (what the S3 tokenizer takes)."""
    return LogMel(TOKENIZER_MEL)(pcm16k.float(), FloorMode.DYNAMIC)


@lru_cache(maxsize=1)
def _fbank_banks() -> torch.Tensor:
    """[FFT_LEN // 2 + 1, 80] Kaldi triangular banks on the mel scale 1127 ln(1 + f/700); Nyquist bin 0."""
    def mel(f: torch.Tensor | float) -> torch.Tensor:
        return 1127.0 * torch.log1p(torch.as_tensor(f, dtype=torch.float32) / 700.0)

    lo, hi = mel(FBANK_LOW_HZ), mel(8_000.0)
    delta = (hi - lo) / (FBANK_BINS + 1)
    b = torch.arange(FBANK_BINS, dtype=torch.float32)[:, None]
    left, center, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta  # [80, 1]
    bins = mel(16_000 / FFT_LEN * torch.arange(FFT_LEN // 2, dtype=torch.float32))[None]  # [1, 256]
    banks = torch.clamp(torch.minimum((bins - left) / (center - left), (right - bins) / (right - center)), min=0)
    return F.pad(banks, (0, 1)).T.contiguous()  # [257, 80]


def kaldi_fbank(pcm16k: torch.Tensor) -> torch.Tensor:
    """[N] float wave in [-1, 1] -> [1 + (N - 400) // 160, 80] log fbank (dither 0, snip_edges)."""
    wav = pcm16k.float()
    frames = wav.unfold(0, FRAME_LEN, FRAME_SHIFT)  # [m, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)  # remove_dc_offset
    prev = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # x[max(0, j - 1)]
    frames = frames - PREEMPHASIS * prev
    window = torch.hann_window(FRAME_LEN, periodic=False).pow(POVEY_POWER)
    spectrum = torch.fft.rfft(F.pad(frames * window, (0, FFT_LEN - FRAME_LEN))).abs().pow(2)  # [m, 257]
    return torch.clamp(spectrum @ _fbank_banks(), min=KALDI_EPS).log()


@lru_cache(maxsize=4)
def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """[new, 1, 2 * width + orig] Hann-windowed sinc kernel of torchaudio's `_get_sinc_resample_kernel`."""
    base = min(orig, new) * ROLLOFF
    width = math.ceil(SINC_WIDTH * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float32)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float32)[:, None, None] / new + idx) * base
    t = t.clamp(-SINC_WIDTH, SINC_WIDTH)
    window = torch.cos(t * math.pi / SINC_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return sinc * window * (base / orig), width


def resample(wav: torch.Tensor, orig_hz: int, new_hz: int) -> torch.Tensor:
    """[N] -> [ceil(N * new / orig)] band-limited resampling (torchaudio `sinc_interp_hann`)."""
    g = math.gcd(orig_hz, new_hz)
    orig, new = orig_hz // g, new_hz // g
    if orig == new:
        return wav.float()
    kernel, width = _sinc_kernel(orig, new)
    x = F.pad(wav.float()[None, None], (width, width + orig))[:, 0]  # [1, N + pads]
    y = F.conv1d(x[:, None], kernel, stride=orig)  # [1, new, L]
    return y.transpose(1, 2).reshape(-1)[: math.ceil(new * wav.numel() / orig)]


def flow_mel(wav24k: torch.Tensor) -> torch.Tensor:
    """[N] 24 kHz -> [N // 480, 80] natural-log mel of §1.7 (reflect pad 720 each side, center=False)."""
    cfg = FLOW_MEL
    pad = (cfg.n_fft - cfg.hop_length) // 2
    y = F.pad(wav24k.float()[None, None], (pad, pad), mode="reflect")[0, 0]
    spec = torch.stft(y, cfg.n_fft, cfg.hop_length, cfg.n_fft, window=torch.hann_window(cfg.n_fft),
                      center=False, return_complex=True)  # [961, T]
    mag = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + FLOW_MEL_EPS)
    filters = torch.from_numpy(slaney_mel_filters(cfg)).float().T  # [80, 961]
    return torch.clamp(filters @ mag, min=FLOW_LOG_CLAMP).log().T.contiguous()  # [T, 80]
