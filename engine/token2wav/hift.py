"""HiFT vocoder (`HiFTGenerator`, CosyVoice2 / Step-Audio2 variant), model.md §1.7.

Parameter names are the `hift.pt` keys minus `generator.`, with weight norm fused into `.weight`.
The NSF randomness (initial phase, additive noise) is an *input*: each session draws it from its own
generator with `draw_nsf`, in the reference's draw order, so batched and graph-captured calls stay
deterministic per session.
Every Snake activation runs through `Snake.fn`: eager by default, or one torch.compile'd function for all of them
(`HiFT.compile_snakes`: five elementwise kernels each fuse into one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import allow_recompiles, compile_symbolic
from engine.token2wav.config import HiFTConfig


def _pad(kernel: int, dilation: int = 1) -> int:
    return (kernel * dilation - dilation) // 2


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], alpha [C]: x + sin²(αx) / α. Its own function with α as a plain input, so one compile with
    symbolic sizes serves every width (as a parameter, α's size would be a guard: one compile per width)."""
    a = alpha[None, :, None]
    return x + (1.0 / (a + 1e-9)) * torch.pow(torch.sin(x * a), 2)


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.fn = snake

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.alpha.detach())  # a plain tensor: a parameter's sizes would be guarded static


class ResBlock(nn.Module):
    def __init__(self, ch: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList([nn.Conv1d(ch, ch, kernel, 1, dilation=d, padding=_pad(kernel, d))
                                     for d in dilations])
        self.convs2 = nn.ModuleList([nn.Conv1d(ch, ch, kernel, 1, padding=_pad(kernel)) for _ in dilations])
        self.activations1 = nn.ModuleList([Snake(ch) for _ in dilations])
        self.activations2 = nn.ModuleList([Snake(ch) for _ in dilations])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = c2(a2(c1(a1(x)))) + x
        return x


class F0Predictor(nn.Module):
    def __init__(self, in_ch: int, cond_ch: int, layers: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for i in range(layers):
            mods += [nn.Conv1d(in_ch if i == 0 else cond_ch, cond_ch, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*mods)
        self.classifier = nn.Linear(cond_ch, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # mel [B, 80, T] → f0 [B, T] (Hz, non-negative)
        return torch.abs(self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1))


class SourceModule(nn.Module):
    """NSF source (`SourceModuleHnNSF2` + `SineGen2`): harmonics merged by Linear(9→1) + tanh."""

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, rand_ini: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        # f0 [B, L, 1] at 24 kHz; rand_ini [B, 9]; noise [B, L, 9] → source [B, L, 1]
        cfg = self.cfg
        scale = cfg.samples_per_frame
        harmonics = torch.arange(1, cfg.nb_harmonics + 2, dtype=torch.float32, device=f0.device)
        fn = f0 * harmonics[None, None, :]
        rad = (fn / cfg.sampling_rate) % 1
        ini = rand_ini.clone()
        ini[:, 0] = 0                                                # no phase noise on the fundamental
        rad[:, 0, :] = rad[:, 0, :] + ini
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * torch.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=float(scale),
                              mode="linear").transpose(1, 2)
        sines = torch.sin(phase) * cfg.nsf_alpha
        uv = (f0 > cfg.nsf_voiced_threshold).type(torch.float32)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        sines = sines * uv + noise_amp * noise
        return torch.tanh(self.l_linear(sines.to(self.l_linear.weight.dtype)))


def draw_nsf(generator: torch.Generator, frames: int, cfg: HiFTConfig, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rand_ini [1, 9], noise [1, frames·480, 9]) in the reference draw order.

    The reference also draws an unused [1, L, 1] noise after these; we draw and drop it so that a
    session generator stays in step with the reference's global RNG under the same seed.
    """
    n = frames * cfg.samples_per_frame
    rand_ini = torch.rand((1, cfg.nb_harmonics + 1), generator=generator, device=device)
    # NOTE: the reference's randn_like fills a tensor with the sines' [B, 9, L]-major strides, and
    # normal_ on such a (non-contiguous) view consumes the generator differently: fill the same view.
    noise = torch.empty((1, cfg.nb_harmonics + 1, n), device=device).transpose(1, 2).normal_(generator=generator)
    torch.randn((1, n, 1), generator=generator, device=device)
    return rand_ini, noise


class HiFT(nn.Module):
    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        base = cfg.base_channels
        self.m_source = SourceModule(cfg)
        self.conv_pre = nn.Conv1d(cfg.in_channels, base, 7, 1, padding=3)
        self.ups = nn.ModuleList([
            nn.ConvTranspose1d(base // 2**i, base // 2**(i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True))])
        n_fft2 = cfg.istft_n_fft + 2
        down_rates = [1, *cfg.upsample_rates[::-1][:-1]]
        cum = [1]
        for r in down_rates[1:]:
            cum.append(cum[-1] * r)
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip(cum[::-1], cfg.source_resblock_kernel_sizes, strict=True)):
            ch = base // 2**(i + 1)
            self.source_downs.append(nn.Conv1d(n_fft2, ch, 1, 1) if u == 1 else
                                     nn.Conv1d(n_fft2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, cfg.resblock_dilations))
        self.resblocks = nn.ModuleList([
            ResBlock(base // 2**(i + 1), k, cfg.resblock_dilations)
            for i in range(len(cfg.upsample_rates)) for k in cfg.resblock_kernel_sizes])
        self.conv_post = nn.Conv1d(base // 2**len(cfg.upsample_rates), n_fft2, 7, 1, padding=3)
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_cond_channels, cfg.f0_layers)
        # periodic Hann computed in float64 and cast, as scipy.signal.get_window does
        window = torch.hann_window(cfg.istft_n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)

    def compile_snakes(self) -> None:
        """Every Snake activation through one torch.compile'd `snake` (dynamic sizes), before the vocoder's
        graphs are captured. Compiling whole ResBlocks instead took a compile per kernel size, padding and
        width (16 on the tiny checkpoint) for little more: their convolutions stay cuDNN calls either way.
        Fused kernels round differently, so the speech is close to, not bit-equal with, eager."""
        allow_recompiles(8)
        fn = compile_symbolic(snake)
        for m in self.modules():
            if isinstance(m, Snake):
                m.fn = fn

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        spec = torch.view_as_real(torch.stft(x, c.istft_n_fft, c.istft_hop, c.istft_n_fft,
                                             window=self.stft_window, return_complex=True))
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)                # [B, 18, frames]

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        s_stft = self._stft(source.squeeze(1))
        x = self.conv_pre(mel)
        n_k = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * n_k](x)
            for j in range(1, n_k):
                xs = xs + self.resblocks[i * n_k + j](x)
            x = xs / n_k
        x = self.conv_post(F.leaky_relu(x, c.post_lrelu_slope))
        half = c.istft_n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half]), max=c.magnitude_clip)
        phase = torch.sin(x[:, half:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.clamp(self._istft(spec), -c.audio_limit, c.audio_limit)

    def _istft(self, spec: torch.Tensor) -> torch.Tensor:
        """torch.istft(center=True) as irfft + overlap-add, without its host-synchronising NOLA check
        (so the vocoder can be captured in a CUDA graph). spec [B, n_fft/2 + 1, T] → [B, hop·(T − 1)]."""
        n, hop = self.cfg.istft_n_fft, self.cfg.istft_hop
        frames = torch.fft.irfft(spec, n=n, dim=1) * self.stft_window[None, :, None]   # [B, n, T]
        t = frames.shape[2]
        length = n + hop * (t - 1)
        fold = lambda x: F.fold(x, (1, length), (1, n), stride=(1, hop)).flatten(1)  # noqa: E731
        wav = fold(frames)
        envelope = fold((self.stft_window ** 2)[None, :, None].expand(1, n, t))
        return (wav / envelope)[:, n // 2: length - n // 2]

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, cache_source: torch.Tensor, rand_ini: torch.Tensor,
                noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T]; cache_source [B, 1, S] → (speech [B, T·480], source [B, 1, T·480])."""
        f0 = self.f0_predictor(mel)                                            # [B, T]
        f0 = F.interpolate(f0[:, None], scale_factor=float(self.cfg.samples_per_frame), mode="nearest")
        source = self.m_source(f0.transpose(1, 2), rand_ini, noise).transpose(1, 2)  # [B, 1, L]
        if cache_source.shape[2] > 0:
            # NOTE: overwrite the head with the previous call's source so the two chunks join without a glitch
            source = torch.cat([cache_source, source[:, :, cache_source.shape[2]:]], dim=2)
        return self.decode(mel, source), source
