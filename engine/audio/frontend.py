"""Per-session Stage0 audio front end: PCM -> 10 LLM embeddings per unit (model.md §2).

The engine calls `encode_unit` once per unit with the unit's client PCM (16,480 samples for unit 0,
16,000 later; any split is accepted, samples beyond the unit's window wait for the next unit), or
`encode_units` for every session with a unit ready in one batch (the same numbers, batched: one log-mel
STFT over all windows, one encoder pass; engine/audio/batched.py).
`encode_reference` is the offline reference-audio path of §2.6 used once per session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.audio.batched import forward_stream_batch
from engine.audio.framing import MelStreamer, MelStreamState, StreamConfig, UnitMel
from engine.audio.graphs import EncoderGraphs
from engine.audio.mel import FloorMode
from engine.config import AudioConfig
from engine.hostio import to_device
from engine.model.audio import (
    ENCODER_FRAMES_PER_SECOND,
    AudioKVCache,
    AudioKVPool,
    AudioProjector,
    WhisperEncoder,
    cnn_length,
    pooled_length,
)


@dataclass
class AudioStreamState:
    """Everything one session's audio front end owns: the mel window and the encoder KV."""

    mel: MelStreamState
    kv: AudioKVCache
    last_unit: UnitMel | None = None  # the most recent unit's mel slice (debugging, tests)

    @property
    def next_unit(self) -> int:
        return self.mel.unit


class AudioFrontEnd:
    """Shared weights + per-session states. Call `encode_unit` while `ready(state)`; each call runs
    exactly one unit (mel slice -> streaming encoder with KV -> projector -> pool -> 10 rows)."""

    def __init__(self, encoder: WhisperEncoder, projector: AudioProjector, cfg: AudioConfig,
                 stream_cfg: StreamConfig | None = None, mel_device: torch.device | str = "cpu",
                 kv_slots: int = 0) -> None:
        """`kv_slots`: sessions whose audio KV lives in one `AudioKVPool` (allocated at the first session, on the
        encoder's device and dtype; the engine's max_sessions); the batched encoder's host work then does not
        grow with the batch. The sessions' mel samples live in as many slots of one `MelPool` (engine/audio/melpool.py),
        so the push, window advance and unit cut do not either. A session beyond them gets a private cache and mel window and still works, batched more slowly."""
        self.encoder, self.projector, self.cfg = encoder, projector, cfg
        if kv_slots < 0:
            raise ValueError(f"kv_slots must be >= 0, got {kv_slots}")
        self.kv_slots = kv_slots
        self.kv_pool: AudioKVPool | None = None
        self.graphs: EncoderGraphs | None = None  # the pooled batch's encoder layers, captured (capture_graphs)
        self.stream_cfg = stream_cfg = stream_cfg or StreamConfig()
        self.streamer = MelStreamer(stream_cfg, mel_device, slots=kv_slots)
        self.block = int(cfg.audio_chunk_length * ENCODER_FRAMES_PER_SECOND)
        # 100 mel frames -> 50 encoder frames -> 10 embeddings (§2.5): the per-unit contract.
        self.embeddings_per_unit = cnn_length(stream_cfg.chunk_frames) // cfg.audio_pool_step

    @property
    def device(self) -> torch.device:
        return self.encoder.conv1.weight.device

    def _pool(self) -> AudioKVPool | None:
        if self.kv_pool is None and self.kv_slots:
            ref = self.encoder.conv1.weight
            self.kv_pool = AudioKVPool.allocate(self.cfg, self.kv_slots, ref.device, ref.dtype)
        return self.kv_pool

    def capture_graphs(self, emit: Callable[[str], None] | None = None, *, eager_replay: bool = False) -> None:
        """Build the encoder graphs for every batch and span bucket of the KV pool (warm-up; needs `kv_slots`).
        `eager_replay`: the same static-input steps without CUDA graphs (CPU)."""
        pool = self._pool()
        if pool is None:
            raise ValueError("encoder graphs need the audio KV pool (kv_slots > 0)")
        graphs = EncoderGraphs(self.encoder, pool, cnn_length(self.stream_cfg.chunk_frames), eager_replay=eager_replay)
        graphs.capture(emit)
        self.graphs = graphs

    def new_session(self) -> AudioStreamState:
        """A session's state; its audio KV a pool slot while one is free (freed when the state is dropped)."""
        self._pool()
        kv = self.kv_pool.take() if self.kv_pool is not None else None
        return AudioStreamState(mel=self.streamer.new_state(), kv=kv or self.encoder.allocate_cache())

    def reset(self, state: AudioStreamState) -> None:
        state.mel.reset(self.stream_cfg, self.streamer.logmel.device)
        state.kv.reset()
        state.kv.resets = 0
        state.last_unit = None

    def push(self, state: AudioStreamState, pcm: torch.Tensor) -> None:
        self.streamer.push(state.mel, pcm)

    def ready(self, state: AudioStreamState) -> bool:
        return self.streamer.ready(state.mel)

    @torch.inference_mode()
    def encode_unit(self, state: AudioStreamState, pcm: torch.Tensor | None = None) -> torch.Tensor:
        """Append `pcm` (float32 16 kHz) and encode the next unit -> [10, llm_hidden]."""
        if pcm is not None:
            self.push(state, pcm)
        unit = self.streamer.next_unit(state.mel)
        state.last_unit = unit
        mel = unit.mel.to(self.device)[None]  # [1, n_mels, 102 | 104]
        hidden = self.encoder.forward_stream(mel, state.kv, unit.prefix_extra, unit.suffix_extra)
        emb = self.projector.embed(hidden, self.cfg.audio_pool_step)[0]  # [10, llm_hidden]
        expected = pooled_length(unit.mel.shape[-1], self.cfg.audio_pool_step)
        if emb.shape[0] != self.embeddings_per_unit or expected != self.embeddings_per_unit:
            raise AssertionError(f"unit {unit.unit}: {emb.shape[0]} audio embeddings, "
                                 f"expected exactly {self.embeddings_per_unit}")
        return emb

    @torch.inference_mode()
    def encode_units(self, states: list[AudioStreamState],
                     pcms: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """`encode_unit` of many sessions at once (each `ready`, each at its own stream point): one
        log-mel over their windows, one encoder pass, one projector -> a [10, llm_hidden] per session."""
        if not states:
            return []
        self.streamer.into_pool([s.mel for s in states])  # a session that started beyond the pool, once
        pcms = pcms or [None] * len(states)
        if any(s.mel.pool is None for s in states):  # a private window takes its PCM on its own: one copy first
            pcms = _on_device(pcms, self.streamer.logmel.device)
        self.streamer.push_many([s.mel for s in states], pcms)  # the pooled ones: one scatter
        units, mels = self.streamer.next_units([s.mel for s in states])
        for state, unit in zip(states, units, strict=True):
            state.last_unit = unit
        self._into_pool(states)
        hidden = forward_stream_batch(self.encoder, units, [s.kv for s in states], mels, self.graphs)  # [B, 50, d]
        emb = self.projector.embed(hidden, self.cfg.audio_pool_step)  # [B, 10, llm_hidden]
        if emb.shape[1] != self.embeddings_per_unit:
            raise AssertionError(f"{emb.shape[1]} audio embeddings per unit, expected {self.embeddings_per_unit}")
        return list(emb.unbind(0))

    def _into_pool(self, states: list[AudioStreamState]) -> None:
        """Sessions that started with a private cache (no slot was free) move into slots freed since.

        NOTE: a closed session's slot is free only once its state is garbage, and the stage0 engine holds a
        closed session until its LLM slot is reused (HistoryRing.owner): the session opened in its place
        starts without an audio slot, so it takes the freed one here, or the batch would stay per-session."""
        pool = self.kv_pool
        if pool is None or not pool.free:
            return
        for state in states:
            if state.kv.pool is not None:
                continue
            kv = pool.take()
            if kv is None:
                return
            n = state.kv.length  # one copy of the frames cached so far (once per such session)
            kv.k[:, :, :, :n] = state.kv.k[:, :, :, :n]
            kv.v[:, :, :, :n] = state.kv.v[:, :, :, :n]
            kv.length, kv.resets = n, state.kv.resets
            state.kv = kv

    def reference_mel(self, pcm16k: torch.Tensor) -> list[torch.Tensor]:
        """§2.6 mel: 30 s pieces, each zero-padded to 30 s, dynamic floor, T = ceil(N / hop) kept."""
        mel_cfg = self.stream_cfg.mel
        piece = int(self.stream_cfg.reference_piece_s * mel_cfg.sample_rate)
        pcm = pcm16k.detach().reshape(-1).to(torch.float32).cpu()
        out = []
        for start in range(0, pcm.numel(), piece):
            chunk = pcm[start: start + piece]
            padded = F.pad(chunk, (0, piece - chunk.numel()))
            feats = self.streamer.logmel(padded, FloorMode.DYNAMIC)  # [n_mels, piece // hop]
            keep = -(-chunk.numel() // mel_cfg.hop_length)
            out.append(feats[:, :keep])
        return out

    @torch.inference_mode()
    def encode_reference(self, pcm16k: torch.Tensor) -> torch.Tensor:
        """Offline reference audio (§2.6) -> [N, llm_hidden], N = 10 per second of audio."""
        mels = self.reference_mel(pcm16k)
        if not mels:
            return torch.zeros(0, self.projector.linear2.out_features, device=self.device)
        # Batch like the reference: mel zero-padded to the longest piece, padding + block masks.
        t_max = max(m.shape[1] for m in mels)
        batch = to_device(torch.stack([F.pad(m, (0, t_max - m.shape[1])) for m in mels]), self.device)
        lengths = to_device(torch.tensor([cnn_length(m.shape[1]) for m in mels]), self.device)
        hidden = self.encoder(batch, lengths=lengths, block=self.block)  # [B, S, d]
        emb = self.projector.embed(hidden, self.cfg.audio_pool_step)  # [B, S // 5, llm_hidden]
        counts = [max(0, pooled_length(m.shape[1], self.cfg.audio_pool_step)) for m in mels]
        return torch.cat([emb[i, :n] for i, n in enumerate(counts)])


def _on_device(pcms: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Host PCM of many sessions -> the mel device in one copy (not one synchronous copy per session)."""
    host = [p for p in pcms if p is not None and p.device != device]
    if not host:
        return pcms
    flat = to_device(torch.cat([p if p.dim() == 1 else p.reshape(-1) for p in host]).detach(), device).float()
    parts = iter(flat.split([p.numel() for p in host]))
    return [next(parts) if p is not None and p.device != device else p for p in pcms]
