"""Whisper log-mel front end in torch (model.md §2.1).

Numerically this follows `WhisperFeatureExtractor._torch_extract_fbank_features` (and the MiniCPM-o
subclass that swaps its floor): periodic Hann STFT with reflect padding, power 2, Slaney mel filters,
log10 with a 1e-10 clamp, the last STFT frame dropped, then a fixed or dynamic floor and (x + 4) / 4.
No torchaudio: the filter bank is built here in float64 exactly like `transformers.audio_utils`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

import numpy as np
import torch

from engine.hostio import to_device


class FloorMode(StrEnum):
    FIXED = "fixed"  # max(x, fixed_floor)
    DYNAMIC = "dynamic"  # max(x, max_all(x) - dynamic_range)


@dataclass(frozen=True)
class MelConfig:
    """Whisper defaults used by MiniCPMAAudioProcessor; every number of §2.1 lives here."""

    sample_rate: int = 16_000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 80
    f_min: float = 0.0
    f_max: float = 8_000.0
    log_clamp: float = 1e-10
    fixed_floor: float = -10.0  # log10 units
    dynamic_range: float = 8.0  # log10 units below the extraction's max
    scale_offset: float = 4.0  # (x + offset) / divisor
    scale_divisor: float = 4.0

    @property
    def n_freqs(self) -> int:
        return self.n_fft // 2 + 1

    def num_frames(self, num_samples: int) -> int:
        """Frames kept for a buffer of `num_samples` (the trailing STFT frame is dropped)."""
        return num_samples // self.hop_length


# Slaney mel scale (librosa / transformers `mel_scale="slaney"`): linear below 1 kHz, log above.
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_MIN_LOG_MEL = 15.0
_SLANEY_LOGSTEP = 27.0 / math.log(6.4)


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    mels = 3.0 * freq / 200.0
    log_region = freq >= _SLANEY_MIN_LOG_HZ
    mels[log_region] = _SLANEY_MIN_LOG_MEL + np.log(freq[log_region] / _SLANEY_MIN_LOG_HZ) * _SLANEY_LOGSTEP
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= _SLANEY_MIN_LOG_MEL
    freq[log_region] = _SLANEY_MIN_LOG_HZ * np.exp((mels[log_region] - _SLANEY_MIN_LOG_MEL) / _SLANEY_LOGSTEP)
    return freq


@lru_cache(maxsize=4)
def slaney_mel_filters(cfg: MelConfig = MelConfig()) -> np.ndarray:
    """[n_freqs, n_mels] float64 triangular filters with Slaney area normalisation."""
    mel_edges = np.linspace(_hz_to_mel(np.array([cfg.f_min]))[0], _hz_to_mel(np.array([cfg.f_max]))[0],
                            cfg.n_mels + 2)
    filter_freqs = _mel_to_hz(mel_edges)  # [n_mels + 2]
    fft_freqs = np.linspace(0, cfg.sample_rate // 2, cfg.n_freqs)  # [n_freqs]
    filter_diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]  # [n_freqs, n_mels + 2]
    down = -slopes[:, :-2] / filter_diff[:-1]
    up = slopes[:, 2:] / filter_diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))  # [n_freqs, n_mels]
    enorm = 2.0 / (filter_freqs[2: cfg.n_mels + 2] - filter_freqs[: cfg.n_mels])
    return filters * enorm[None, :]


class LogMel:
    """Stateless log-mel extractor; holds the window and filter bank on one device."""

    def __init__(self, cfg: MelConfig = MelConfig(), device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.window = torch.hann_window(cfg.n_fft, periodic=True, device=self.device)  # [n_fft]
        # [n_mels, n_freqs] fp32, as the reference casts the float64 bank before the matmul.
        self.filters_t = torch.from_numpy(slaney_mel_filters(cfg)).to(self.device, torch.float32).T.contiguous()

    def raw(self, waveform: torch.Tensor) -> torch.Tensor:
        """log10 mel before the floor: [N] -> [n_mels, N // hop]. Requires N >= n_fft // 2 + 1."""
        cfg = self.cfg
        wav = waveform.to(self.device, torch.float32)
        stft = torch.stft(wav, cfg.n_fft, cfg.hop_length, window=self.window, center=True,
                          pad_mode="reflect", return_complex=True)  # [n_freqs, N // hop + 1]
        power = (stft[..., :-1].abs() ** 2).contiguous()  # [n_freqs, T]: last frame dropped
        mel = self.filters_t @ power  # [n_mels, T]
        return torch.clamp(mel, min=cfg.log_clamp).log10()

    def floor_and_scale(self, log_spec: torch.Tensor, mode: FloorMode) -> torch.Tensor:
        """Apply the §2.1 floor over the whole extraction, then (x + 4) / 4."""
        cfg = self.cfg
        if mode is FloorMode.DYNAMIC:
            floor = log_spec.max() - cfg.dynamic_range
        else:
            floor = torch.tensor(cfg.fixed_floor, dtype=log_spec.dtype, device=log_spec.device)
        return (torch.maximum(log_spec, floor) + cfg.scale_offset) / cfg.scale_divisor

    def __call__(self, waveform: torch.Tensor, mode: FloorMode) -> torch.Tensor:
        """[N] float PCM -> [n_mels, N // hop] features."""
        return self.floor_and_scale(self.raw(waveform), mode)

    def batch(self, waveforms: list[torch.Tensor], modes: list[FloorMode]) -> list[torch.Tensor]:
        """Many windows [N_i] of different lengths in one STFT: item i is `self(waveforms[i], modes[i])`.

        Each window is reflect-padded on its own (what `center=True` does), then zero-padded on the right
        to the longest; the frames past a window's own N // hop never mix into its valid frames, and its
        dynamic floor is the max over its valid frames only. The padded batch is one gather from the
        windows laid end to end, so the ops dispatched do not grow with the number of windows (issue 15).
        """
        sizes = [w.numel() for w in waveforms]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        flat = to_device(torch.cat(waveforms), self.device).to(torch.float32)  # [sum N_i]
        out = self.batch_padded(flat, sizes, starts, modes)
        return [out[i, :, :n // self.cfg.hop_length] for i, n in enumerate(sizes)]

    def batch_padded(self, flat: torch.Tensor, sizes: list[int], starts: list[int], modes: list[FloorMode],
                     ring: int = 0, rows: list[int] | None = None) -> torch.Tensor:
        """`batch` over windows read from `flat` (fp32, on this device): window i is flat[starts[i]:][:sizes[i]],
        or with `ring` the samples flat[rows[i] + (starts[i] + j) % ring] (a MelPool slot) -> [B, n_mels, T_max]
        features; the frames past a window's own sizes[i] // hop are not its features (padding)."""
        cfg, half = self.cfg, self.cfg.n_fft // 2
        frames = [n // cfg.hop_length for n in sizes]
        # every per-window number in one host -> device copy (no blocking copy on CUDA)
        info = to_device(torch.tensor([sizes, starts, frames, [m is FloorMode.DYNAMIC for m in modes],
                                       rows or [0] * len(sizes)], dtype=torch.int32), self.device)  # [5, B]
        size, start, frame, dynamic, row = (r[:, None] for r in info.unbind(0))  # [B, 1] each; int32: [B, L] index
        pos = torch.arange(-half, max(sizes) + half, device=self.device, dtype=torch.int32)[None]  # [1, L]
        reflected = pos.abs()  # [1, L]: index in the window, the left edge mirrored
        index = 2 * (size - 1) - reflected  # [B, L]: the right edge mirrored
        torch.minimum(index, reflected, out=index).clamp_(min=0).add_(start)  # both edges, into `flat`
        if ring:
            index.remainder_(ring).add_(row)
        wav = flat[index].masked_fill_(pos >= size + half, 0.0)  # [B, L]: reflect-padded, zeros past the end
        stft = torch.stft(wav, cfg.n_fft, cfg.hop_length, window=self.window, center=False,
                          return_complex=True)  # [B, n_freqs, 1 + (L - n_fft) // hop]
        t_max = max(frames)
        power = (stft[..., :t_max].abs() ** 2).contiguous()  # [B, n_freqs, T_max]
        log_spec = torch.clamp(self.filters_t @ power, min=cfg.log_clamp).log10()  # [B, n_mels, T_max]
        valid = torch.arange(t_max, device=self.device)[None, :] < frame  # [B, T_max]
        peak = log_spec.masked_fill(~valid[:, None, :], float("-inf")).amax(dim=(1, 2))  # [B]
        floor = torch.where(dynamic[:, 0].bool(), peak - cfg.dynamic_range, torch.full_like(peak, cfg.fixed_floor))
        return (torch.maximum(log_spec, floor[:, None, None]) + cfg.scale_offset) / cfg.scale_divisor
