"""Unit framing and the exact streaming mel buffer (model.md §2.2, §2.3).

The mel stream is `prefix_zeros` zero samples followed by the client PCM. Unit k analyses the
stream window that the reference `StreamingMelProcessorExact` holds with 1 s deliveries, i.e. stream
samples up to `first_chunk_samples + chunk * k` (16,480 + 16,000·k, model.md §2.3), minus whatever
slid out on the left. The reference pads its first delivery to 16,560 samples but hands the processor
only the 16,480 it consumes and carries the other 80 into the next unit, so the 80 samples beyond the
unit never enter the analysis window. Later samples wait in `pending` for the next unit. The whole
window is re-analysed every unit so the dynamic floor sees exactly the reference's window
(reflect-padded edges included); the window equals what readiness requires, so it does not depend on
how far ahead the caller delivered. A streamer with `slots` keeps its sessions' samples in one `MelPool`
(a ring per session, engine/audio/melpool.py): the window then advances and slides by index arithmetic, and
`next_units` reads every window and cuts every unit with one gather each (issue 15).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.audio.mel import FloorMode, LogMel, MelConfig
from engine.audio.melpool import MelPool
from engine.hostio import to_device

# A pooled session's ring holds its window (below the 30 s slide trigger plus one unit) and this much received
# ahead of it; a session pushed further ahead leaves the pool (MelStreamer.push).
POOL_AHEAD_S = 2.0


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
    """Per-session mel stream: the analysis window, samples held back, and global cursors.

    The samples live in `buffer` and `pending`, or (a pooled state) in slot `slot` of `pool`, a ring indexed
    by stream sample: then the window is stream samples [base_sample, window_end) and `pending` the rest up
    to `received`, and `buffer` / `pending` stay empty."""

    buffer: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [L] fp32 window
    pending: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [P] received, not analysed
    base_sample: int = 0  # global stream index of buffer[0]
    unit: int = 0  # next unit index
    received: int = 0  # stream samples received, prefix zeros included
    pool: MelPool | None = field(default=None, repr=False)
    slot: int = -1
    window_end: int = 0  # pooled: global stream index one past the window

    @property
    def length(self) -> int:
        """Samples in the analysis window."""
        return self.window_end - self.base_sample if self.pool is not None else self.buffer.numel()

    def reset(self, cfg: StreamConfig, device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(0, device=device)
        # the mel stream starts with 560 zeros: the reference left-pads its first delivery (model.md §2.2)
        if self.pool is not None:
            self.pool.clear(self.slot, cfg.prefix_zeros)
            self.pending = torch.zeros(0, device=device)
        else:
            self.pending = torch.zeros(cfg.prefix_zeros, device=device)
        self.base_sample = self.window_end = 0
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
    """Stateless driver over `MelStreamState`; one per process, one state per session. With `slots`, the first
    `slots` live sessions' samples are slots of one `MelPool` on the log-mel device (`next_units` then
    dispatches as many ops for 64 sessions as for one); a session beyond them has tensors of its own."""

    def __init__(self, cfg: StreamConfig = StreamConfig(), device: torch.device | str = "cpu", slots: int = 0) -> None:
        self.cfg = cfg
        self.logmel = LogMel(cfg.mel, device)
        self.slots = slots
        self.pool: MelPool | None = None
        sr = cfg.mel.sample_rate
        self.ring_capacity = int(cfg.slide_trigger_s * sr) + cfg.first_chunk_samples + int(POOL_AHEAD_S * sr)

    def new_state(self) -> MelStreamState:
        state = MelStreamState()
        if self.pool is None and self.slots:
            self.pool = MelPool.allocate(self.slots, self.ring_capacity, self.logmel.device)
        slot = self.pool.take(state) if self.pool is not None else None
        if slot is not None:
            state.pool, state.slot = self.pool, slot
        state.reset(self.cfg, self.logmel.device)  # the window lives where its log-mel runs: no copy per unit
        return state

    def push(self, state: MelStreamState, pcm: torch.Tensor) -> None:
        """Append client PCM (float32 mono 16 kHz, any length)."""
        self.push_many([state], [pcm])

    def push_many(self, states: list[MelStreamState], pcms: list[torch.Tensor | None]) -> None:
        """`push` of many sessions; the pooled ones' PCM goes into the pool with one scatter (MelPool.write)."""
        pooled: list[tuple[MelStreamState, torch.Tensor]] = []
        for state, pcm in zip(states, pcms, strict=True):
            if pcm is None:
                continue
            if pcm.dim() != 1:
                pcm = pcm.reshape(-1)
            if state.pool is not None and state.received + pcm.numel() - state.base_sample > state.pool.capacity:
                self._leave_pool(state)  # pushed too far ahead of its window for the ring
            if state.pool is None:
                pcm = pcm.detach().to(state.pending.device, torch.float32)
                state.pending = torch.cat([state.pending, pcm])
                state.received += pcm.numel()
            else:
                pooled.append((state, pcm))
        for pool in {id(s.pool): s.pool for s, _ in pooled}.values():  # one pool, as a rule
            group = [(s, p) for s, p in pooled if s.pool is pool]
            pcm = _flat([p for _, p in group], pool.device)
            pool.write([s.slot for s, _ in group], [s.received for s, _ in group], [p.numel() for _, p in group], pcm)
            for s, p in group:
                s.received += p.numel()

    def _leave_pool(self, state: MelStreamState) -> None:
        """The state's samples into tensors of its own. NOTE: its slot stays taken until the state is garbage (the
        finalizer frees it then); only a session pushed seconds ahead of its units comes here."""
        pool = state.pool
        assert pool is not None
        state.buffer = pool.read(state.slot, state.base_sample, state.window_end)
        state.pending = pool.read(state.slot, state.window_end, state.received)
        state.pool, state.slot = None, -1

    def into_pool(self, states: list[MelStreamState]) -> None:
        """States with samples of their own (no slot was free at their start) move into slots freed since (once
        per such session: a copy of its samples), so that their batches take the pooled path."""
        pool = self.pool
        if pool is None or not pool.free:
            return
        for state in states:
            if state.pool is not None or state.received - state.base_sample > pool.capacity:
                continue
            slot = pool.take(state)
            if slot is None:
                return
            samples = torch.cat([state.buffer, state.pending])  # stream samples [base_sample, received)
            pool.write([slot], [state.base_sample], [samples.numel()], to_device(samples, pool.device))
            state.window_end = state.base_sample + state.buffer.numel()
            state.pool, state.slot = pool, slot
            state.buffer, state.pending = state.buffer[:0], state.pending[:0]

    def ready(self, state: MelStreamState) -> bool:
        return state.received >= self.cfg.ready_stream_samples(state.unit)

    def window(self, state: MelStreamState) -> torch.Tensor:
        """The analysis window [L] (a pooled state's: a copy out of its ring)."""
        if state.pool is None:
            return state.buffer
        return state.pool.read(state.slot, state.base_sample, state.window_end)

    def next_unit(self, state: MelStreamState) -> UnitMel:
        """Advance the window to unit `state.unit` and emit its mel slice. Requires `ready`."""
        floor = self.advance(state)
        return self.cut(state, floor, self.logmel(self.window(state), floor))

    def next_units(self, states: list[MelStreamState]) -> tuple[list[UnitMel], torch.Tensor | None]:
        """`next_unit` of many sessions with one batched log-mel over their windows, and when every state is a
        slot of one pool on the log-mel device, their mel slices stacked [B, n_mels, T_max] and zero-padded on the
        right (a first unit's 102 frames among 104): the windows read with one gather, the slices cut with one
        (ops that do not grow with the batch); else None."""
        floors = [self.advance(s) for s in states]
        pool = states[0].pool if states else None
        if pool is None or pool.device != self.logmel.window.device or any(s.pool is not pool for s in states):
            mels = self.logmel.batch([self.window(s) for s in states], floors)
            return [self.cut(s, f, m) for s, f, m in zip(states, floors, mels, strict=True)], None
        cap = pool.capacity
        full = self.logmel.batch_padded(pool.data.view(-1), [s.length for s in states],
                                        [s.base_sample % cap for s in states], floors, ring=cap,
                                        rows=[s.slot * cap for s in states])  # [B, n_mels, T_win]
        return self._cut_stacked(states, floors, full)

    def _cut_stacked(self, states: list[MelStreamState], floors: list[FloorMode],
                     full: torch.Tensor) -> tuple[list[UnitMel], torch.Tensor]:
        """`cut` of every state from its window's features full[i] with one gather -> the units, [B, n_mels, T]."""
        spans = [self._span(s) for s in states]  # (first frame in the window, frames); advances each state
        t = max(n for _, n in spans)
        dev = full.device
        first, count = to_device(torch.tensor(spans, dtype=torch.int64).T.contiguous(), dev).unbind(0)  # [B] each
        j = torch.arange(t, device=dev)  # [T]
        index = (first[:, None] + j).clamp_(max=full.shape[2] - 1)  # [B, T]: a first unit's 2 extra clamped
        mels = full.gather(2, index[:, None, :].expand(-1, full.shape[1], -1))  # [B, n_mels, T]
        mels.masked_fill_((j >= count[:, None])[:, None, :], 0.0)  # what `forward_stream_batch` pads with
        units = [self._unit(s, f, m if n == t else m[:, :n])
                 for s, f, m, (_, n) in zip(states, floors, mels.unbind(0), spans, strict=True)]
        return units, mels

    def advance(self, state: MelStreamState) -> FloorMode:
        """Move unit `state.unit`'s samples into the window and slide it; the floor its log-mel takes."""
        cfg = self.cfg
        k = state.unit
        if not self.ready(state):
            raise ValueError(f"unit {k}: needs {cfg.ready_stream_samples(k)} stream samples, "
                             f"have {state.received}")
        end = min(state.received, cfg.buffer_end(k))
        if state.pool is not None:
            state.window_end = end  # the ring already holds the samples: index arithmetic only
        else:
            take = end - (state.base_sample + state.buffer.numel())
            state.buffer = torch.cat([state.buffer, state.pending[:take]])
            state.pending = state.pending[take:]
        self._maybe_slide(state)
        length = state.length
        return FloorMode.FIXED if length < cfg.dynamic_floor_min_s * cfg.mel.sample_rate else FloorMode.DYNAMIC

    def cut(self, state: MelStreamState, floor: FloorMode, mel_full: torch.Tensor) -> UnitMel:
        """The unit's emitted slice of the window's log-mel `mel_full` [n_mels, T_local]; next unit."""
        first, n = self._span(state)
        return self._unit(state, floor, mel_full[:, first: first + n])

    def _span(self, state: MelStreamState) -> tuple[int, int]:
        """(first frame in the window's features, frames) of unit `state.unit`'s slice; next unit."""
        cfg, hop = self.cfg, self.cfg.mel.hop_length
        k, length = state.unit, state.length
        base_frame = state.base_sample // hop
        stable = min(length // hop, (length - cfg.mel.n_fft // 2) // hop + 1)
        start, stop = cfg.emitted_frames(k)
        if base_frame + stable < stop:  # guaranteed by `ready`; kept as a loud invariant
            raise AssertionError(f"unit {k}: only {base_frame + stable} stable frames, need {stop}")
        state.unit += 1
        return start - base_frame, stop - start

    def _unit(self, state: MelStreamState, floor: FloorMode, mel: torch.Tensor) -> UnitMel:
        """The UnitMel of the unit just cut (`state.unit` - 1)."""
        cfg = self.cfg
        k = state.unit - 1
        start, stop = cfg.emitted_frames(k)
        core = cfg.chunk_frames * k
        return UnitMel(mel=mel, unit=k, frames=(start, stop), prefix_extra=core - start,
                       suffix_extra=stop - core - cfg.chunk_frames, floor=floor,
                       buffer_samples=state.length, base_sample=state.base_sample)

    def _maybe_slide(self, state: MelStreamState) -> None:
        """Trigger-mode slide of the reference: at >= 30 s drop 10 s (keep >= 1 s, hop-aligned)."""
        cfg = self.cfg
        sr, hop = cfg.mel.sample_rate, cfg.mel.hop_length
        length = state.length
        if length < int(cfg.slide_trigger_s * sr):
            return
        stride = int(cfg.slide_stride_s * sr)
        guard = min(int(cfg.slide_min_keep_s * sr), length - stride)
        drop = min(stride, max(0, length - guard)) // hop * hop
        if drop <= 0:
            return
        if state.pool is None:
            state.buffer = state.buffer[drop:]
        state.base_sample += drop


def _flat(pcms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Many 1-D PCM tensors -> one fp32 [sum N_i] on `device` (one copy when they are all on the host)."""
    if len({p.device for p in pcms}) > 1:
        pcms = [to_device(p, device) for p in pcms]
    return to_device(torch.cat(pcms).detach(), device).to(torch.float32)
