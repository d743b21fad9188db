"""Unit framing and the exact streaming mel buffer (model.md §2.2, §2.3).

The mel stream is `prefix_zeros` zero samples followed by the client PCM. Unit k analyses the
stream window that the reference `StreamingMelProcessorExact` holds with 1 s deliveries, i.e. stream
samples up to `first_chunk_samples + chunk * k` (16,480 + 16,000·k, model.md §2.3), minus whatever
slid out on the left. The reference pads its first delivery to 16,560 samples but hands the processor
only the 16,480 it consumes and carries the other 80 into the next unit, so the 80 samples beyond the
unit never enter the analysis window. Later samples wait in `pending` for the next unit. The whole
window is re-analysed every unit so the dynamic floor sees exactly the reference's window
(reflect-padded edges included); the window equals what readiness requires, so it does not depend on
how far ahead the caller delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.audio.mel import FloorMode, LogMel, MelConfig


@dataclass(frozen=True)
class StreamConfig:
    """Streaming constants of the reference (Demo-Proc, Demo-U); names follow the reference."""

    mel: MelConfig = MelConfig()
    chunk_ms: int = 1000
    first_chunk_ms: int = 1035
    cnn_redundancy_ms: int = 20
    slide_trigger_s: float = 30.0
    slide_stride_s: float = 10.0
    slide_min_keep_s: float = 1.0
    dynamic_floor_min_s: float = 5.0  # buffers shorter than this use the fixed floor
    reference_piece_s: float = 30.0  # offline path: clip length per encoder pass

    def _samples(self, ms: float) -> int:
        return int(round(ms * self.mel.sample_rate / 1000))

    @property
    def chunk_samples(self) -> int:
        return self._samples(self.chunk_ms)

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // self.mel.hop_length

    @property
    def first_chunk_raw(self) -> int:
        """Samples of the (left-padded) first delivery: 16,560."""
        return self._samples(self.first_chunk_ms)

    @property
    def first_chunk_samples(self) -> int:
        """The first unit's stream samples, hop-aligned down: 16,480 (1030 ms)."""
        hop = self.mel.hop_length
        return max(hop, self.first_chunk_raw // hop * hop)

    @property
    def prefix_zeros(self) -> int:
        """Zeros in front of the client PCM: the first 1 s delivery left-padded to 1035 ms = 560."""
        return self.first_chunk_raw - self.chunk_samples

    @property
    def redundancy_frames(self) -> int:
        return int(self.cnn_redundancy_ms * self.mel.sample_rate / 1000) // self.mel.hop_length

    def ready_stream_samples(self, unit: int) -> int:
        """Stream samples needed before unit `unit` can run (all its emitted frames are stable)."""
        return self.first_chunk_samples + self.chunk_samples * unit

    def ready_client_samples(self, unit: int) -> int:
        """Client samples needed before unit `unit` can run: 15,920 + 16,000·k."""
        return self.ready_stream_samples(unit) - self.prefix_zeros

    def buffer_end(self, unit: int) -> int:
        """Exclusive stream index the reference buffer reaches at unit `unit`: 16,480 + 16,000·k."""
        return self.first_chunk_samples + self.chunk_samples * unit

    def emitted_frames(self, unit: int) -> tuple[int, int]:
        """Global mel frame range emitted for `unit`: [0, 102), then [100k - 2, 100k + 102)."""
        core = self.chunk_frames * unit
        r = self.redundancy_frames
        return max(0, core - r), core + self.chunk_frames + r


@dataclass
class MelStreamState:
    """Per-session mel stream: the analysis window, samples held back, and global cursors."""

    buffer: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [L] fp32 window
    pending: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [P] received, not analysed
    base_sample: int = 0  # global stream index of buffer[0]
    unit: int = 0  # next unit index
    received: int = 0  # stream samples received, prefix zeros included

    def reset(self, cfg: StreamConfig, device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(0, device=device)
        # the mel stream starts with 560 zeros: the reference left-pads its first delivery (model.md §2.2)
        self.pending = torch.zeros(cfg.prefix_zeros, device=device)
        self.base_sample = 0
        self.unit = 0
        self.received = cfg.prefix_zeros


@dataclass(frozen=True)
class UnitMel:
    """One unit's emitted mel slice and where it came from (for the encoder trim and for tests)."""

    mel: torch.Tensor  # [n_mels, T] with T = 102 (unit 0) or 104
    unit: int
    frames: tuple[int, int]  # global [start, end) mel frames
    prefix_extra: int  # left redundancy frames in `mel` (0 for unit 0)
    suffix_extra: int
    floor: FloorMode
    buffer_samples: int  # window length the floor was computed over
    base_sample: int


class MelStreamer:
    """Stateless driver over `MelStreamState`; one per process, one state per session."""

    def __init__(self, cfg: StreamConfig = StreamConfig(), device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.logmel = LogMel(cfg.mel, device)

    def new_state(self) -> MelStreamState:
        state = MelStreamState()
        state.reset(self.cfg, self.logmel.device)  # the window lives where its log-mel runs: no copy per unit
        return state

    def push(self, state: MelStreamState, pcm: torch.Tensor) -> None:
        """Append client PCM (float32 mono 16 kHz, any length)."""
        pcm = pcm.detach().reshape(-1).to(state.pending.device, torch.float32)
        state.pending = torch.cat([state.pending, pcm])
        state.received += pcm.numel()

    def ready(self, state: MelStreamState) -> bool:
        return state.received >= self.cfg.ready_stream_samples(state.unit)

    def next_unit(self, state: MelStreamState) -> UnitMel:
        """Advance the window to unit `state.unit` and emit its mel slice. Requires `ready`."""
        floor = self.advance(state)
        return self.cut(state, floor, self.logmel(state.buffer, floor))

    def next_units(self, states: list[MelStreamState]) -> list[UnitMel]:
        """`next_unit` of many sessions with one batched log-mel over their windows (LogMel.batch)."""
        floors = [self.advance(s) for s in states]
        mels = self.logmel.batch([s.buffer for s in states], floors)
        return [self.cut(s, f, m) for s, f, m in zip(states, floors, mels, strict=True)]

    def advance(self, state: MelStreamState) -> FloorMode:
        """Move unit `state.unit`'s samples into the window and slide it; the floor its log-mel takes."""
        cfg = self.cfg
        k = state.unit
        if not self.ready(state):
            raise ValueError(f"unit {k}: needs {cfg.ready_stream_samples(k)} stream samples, "
                             f"have {state.received}")
        end = min(state.received, cfg.buffer_end(k))
        take = end - (state.base_sample + state.buffer.numel())
        state.buffer = torch.cat([state.buffer, state.pending[:take]])
        state.pending = state.pending[take:]
        self._maybe_slide(state)
        length = state.buffer.numel()
        return FloorMode.FIXED if length < cfg.dynamic_floor_min_s * cfg.mel.sample_rate else FloorMode.DYNAMIC

    def cut(self, state: MelStreamState, floor: FloorMode, mel_full: torch.Tensor) -> UnitMel:
        """The unit's emitted slice of the window's log-mel `mel_full` [n_mels, T_local]; next unit."""
        cfg, hop = self.cfg, self.cfg.mel.hop_length
        k, length = state.unit, state.buffer.numel()
        base_frame = state.base_sample // hop
        stable = min(mel_full.shape[1], (length - cfg.mel.n_fft // 2) // hop + 1)
        start, stop = cfg.emitted_frames(k)
        if base_frame + stable < stop:  # guaranteed by `ready`; kept as a loud invariant
            raise AssertionError(f"unit {k}: only {base_frame + stable} stable frames, need {stop}")
        mel = mel_full[:, start - base_frame: stop - base_frame]
        core = cfg.chunk_frames * k
        state.unit += 1
        return UnitMel(mel=mel, unit=k, frames=(start, stop), prefix_extra=core - start,
                       suffix_extra=stop - core - cfg.chunk_frames, floor=floor,
                       buffer_samples=length, base_sample=state.base_sample)

    def _maybe_slide(self, state: MelStreamState) -> None:
        """Trigger-mode slide of the reference: at >= 30 s drop 10 s (keep >= 1 s, hop-aligned)."""
        cfg = self.cfg
        sr, hop = cfg.mel.sample_rate, cfg.mel.hop_length
        length = state.buffer.numel()
        if length < int(cfg.slide_trigger_s * sr):
            return
        stride = int(cfg.slide_stride_s * sr)
        guard = min(int(cfg.slide_min_keep_s * sr), length - stride)
        drop = min(stride, max(0, length - guard)) // hop * hop
        if drop <= 0:
            return
        state.buffer = state.buffer[drop:]
        state.base_sample += drop
