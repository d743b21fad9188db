"""Stage0 front end: framing (I4), floor switching, slide, 10 per unit (I3), reference path (§2.6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from engine.audio import AudioFrontEnd, FloorMode, LogMel, StreamConfig
from engine.model.audio import pooled_length
from tests.engine.test_audio_encoder import build, tiny_audio

SR = 16_000
CFG = StreamConfig()


class RefExtractor(WhisperFeatureExtractor):
    """Transcription of MiniCPMAAudioProcessor: Whisper extractor with a switchable floor."""

    dynamic = True

    def _torch_extract_fbank_features(self, waveform: np.ndarray, device: str = "cpu") -> np.ndarray:
        wav = torch.from_numpy(waveform).to(device, torch.float32)
        stft = torch.stft(wav, n_fft=self.n_fft, hop_length=self.hop_length,
                          window=torch.hann_window(self.n_fft), return_complex=True)
        mel = torch.from_numpy(self.mel_filters).float().T @ (stft[..., :-1].abs() ** 2)
        log_spec = torch.clamp(mel, min=1e-10).log10()
        if self.dynamic:
            peak = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]
            log_spec = torch.maximum(log_spec, peak - 8.0)
        else:
            log_spec = torch.maximum(log_spec, torch.tensor(-10.0))
        return ((log_spec + 4.0) / 4.0).numpy()


class RefStreamingMel:
    """Transcription of StreamingMelProcessorExact (chunk 1000 ms, first 1035 ms, redundancy 20 ms,
    trigger-mode sliding window 30 s / 10 s) as configured by the duplex demo."""

    def __init__(self) -> None:
        self.fe = RefExtractor()
        self.buffer = np.zeros(0, dtype=np.float32)
        self.last_emitted_T, self.base_T = 0, 0

    def _slide(self) -> None:
        n = len(self.buffer)
        if n < 30 * SR:
            return
        guard = min(SR, n - 10 * SR)
        drop = min(10 * SR, max(0, n - guard)) // 160 * 160
        if drop > 0:
            self.buffer, self.base_T = self.buffer[drop:], self.base_T + drop // 160

    def process(self, chunk: np.ndarray) -> tuple[np.ndarray, int]:
        self.buffer = np.concatenate([self.buffer, chunk.astype(np.float32)])
        self._slide()
        self.fe.dynamic = len(self.buffer) >= 5 * SR
        mel = self.fe(self.buffer, sampling_rate=SR, return_tensors="np", padding=False).input_features[0]
        stable = min(mel.shape[1], (len(self.buffer) - 200) // 160 + 1)
        core_start, core_end = self.last_emitted_T, self.last_emitted_T + 100
        assert self.base_T + stable >= core_end + 2
        start, stop = max(0, core_start - 2) - self.base_T, core_end + 2 - self.base_T
        self.last_emitted_T = core_end
        return mel[:, max(0, start):stop], self.base_T


def _client_pcm(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    env = 0.05 + 0.5 * (np.sin(np.arange(n) / SR * 2 * np.pi * 0.3) > 0.5)  # loud and quiet stretches
    return (env * rng.standard_normal(n)).astype(np.float32)


def _wire_units(pcm: np.ndarray, units: int) -> list[torch.Tensor]:
    """Wire protocol framing: unit 0 = 16,480 client samples, later units 16,000."""
    bounds = [0] + [16_480 + 16_000 * k for k in range(units)]
    return [torch.from_numpy(pcm[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.fixture(scope="module")
def frontend() -> AudioFrontEnd:
    enc, proj = build(seed=11)
    return AudioFrontEnd(enc, proj, tiny_audio())


def test_config_arithmetic() -> None:
    assert (CFG.prefix_zeros, CFG.first_chunk_samples, CFG.first_chunk_raw) == (560, 16_480, 16_560)
    assert CFG.redundancy_frames == 2 and CFG.chunk_frames == 100
    assert [CFG.ready_client_samples(k) for k in range(3)] == [15_920, 31_920, 47_920]
    assert [CFG.emitted_frames(k) for k in range(3)] == [(0, 102), (98, 202), (198, 302)]


def test_mel_stream_matches_reference_processor_across_floor_switch_and_slide(frontend) -> None:
    """I4 + §2.3: per-unit mel equals the reference processor fed as the demo feeds it (1 s deliveries,
    the first left-padded to 1035 ms, the processor handed only the 16,480 / 16,000 samples a unit
    consumes), through the fixed->dynamic switch (unit 4) and the buffer slide (unit 29)."""
    units = 31
    pcm = _client_pcm(units + 1, seed=1)
    ref = RefStreamingMel()
    ours = frontend.streamer.new_state()
    carry = np.zeros(0, np.float32)  # the demo's audio_buffer: what the processor has not consumed yet
    for k, chunk in enumerate(_wire_units(pcm, units)):
        delivery = pcm[16_000 * k: 16_000 * (k + 1)]
        if k == 0:
            delivery = np.concatenate([np.zeros(560, np.float32), delivery])
        carry = np.concatenate([carry, delivery])
        need = 16_480 if k == 0 else 16_000  # the processor gets exactly the consumed samples; 80 carry over
        ref_mel, ref_base = ref.process(carry[:need])
        carry = carry[need:]
        frontend.streamer.push(ours, chunk)
        unit = frontend.streamer.next_unit(ours)
        assert unit.frames == CFG.emitted_frames(k)
        assert unit.buffer_samples == len(ref.buffer) and unit.base_sample == ref_base * 160
        assert unit.floor is (FloorMode.FIXED if k < 4 else FloorMode.DYNAMIC)
        assert unit.mel.shape == ref_mel.shape == (80, 102 if k == 0 else 104)
        np.testing.assert_allclose(unit.mel.numpy(), ref_mel, atol=1e-5, rtol=0, err_msg=f"unit {k}")
    assert ours.base_sample == 160_000  # slid once, at unit 29


def test_zero_prefix_and_readiness(frontend) -> None:
    """I4: the stream is 560 zeros + PCM; unit k is ready at exactly 15,920 + 16,000k client samples."""
    pcm = torch.from_numpy(_client_pcm(3, seed=2))
    state = frontend.streamer.new_state()
    fed = 0
    for k in range(2):
        need = 15_920 + 16_000 * k
        frontend.streamer.push(state, pcm[fed: need - 1])
        fed = need - 1
        assert not frontend.streamer.ready(state)
        with pytest.raises(ValueError):
            frontend.streamer.next_unit(state)
        frontend.streamer.push(state, pcm[fed: need])
        fed = need
        assert frontend.streamer.ready(state)
        unit = frontend.streamer.next_unit(state)
        stream = torch.cat([torch.zeros(560), pcm[:need]])
        full = LogMel()(stream, FloorMode.FIXED)  # fixed floor: frames do not depend on the window
        start, stop = CFG.emitted_frames(k)
        torch.testing.assert_close(unit.mel, full[:, start:stop], atol=0, rtol=0)


def test_front_end_units_equal_offline_block_causal(frontend) -> None:
    """I1 end to end over the fixed-floor units: front-end embeddings == offline encoder over one mel."""
    units = 4
    pcm = _client_pcm(5, seed=3)
    state = frontend.new_session()
    streamed = torch.cat([frontend.encode_unit(state, c) for c in _wire_units(pcm, units)])
    stream = torch.cat([torch.zeros(560), torch.from_numpy(pcm)])
    mel = LogMel()(stream, FloorMode.FIXED)[:, : 100 * units + 2]
    with torch.no_grad():
        hidden = frontend.encoder(mel[None], block=frontend.block)
        offline = frontend.projector.embed(hidden, 5)[0, : 10 * units]
    torch.testing.assert_close(streamed, offline, atol=1e-5, rtol=1e-5)


def test_ten_embeddings_per_unit_including_post_reset() -> None:
    """I3 through the front end with 200 source positions: resets at units 3 and 6."""
    enc, proj = build(max_source_positions=200, seed=12)
    fe = AudioFrontEnd(enc, proj, tiny_audio(200))
    state = fe.new_session()
    pcm = _client_pcm(8, seed=4)
    shapes = [tuple(fe.encode_unit(state, c).shape) for c in _wire_units(pcm, 7)]
    assert shapes == [(10, 128)] * 7
    assert state.kv.resets == 2 and state.next_unit == 7


def test_reference_audio_path(frontend) -> None:
    """§2.6: 30 s pieces, HF mel zero-padded to 30 s (dynamic floor), block + padding masks, 10/s."""
    pcm = _client_pcm(65, seed=5)
    out = frontend.encode_reference(torch.from_numpy(pcm))
    assert out.shape == (650, 128)
    hf = WhisperFeatureExtractor()
    pieces = [pcm[i: i + 30 * SR] for i in range(0, len(pcm), 30 * SR)]
    feats = hf(pieces, sampling_rate=SR, return_tensors="pt", padding="max_length", return_attention_mask=True)
    lens = feats["attention_mask"].sum(1)  # ceil(N / 160) per piece
    mel = torch.stack([f * (torch.arange(3000) < n) for f, n in zip(feats["input_features"], lens, strict=True)])
    with torch.no_grad():
        cnn = (lens - 1) // 2 + 1
        hidden = frontend.encoder(mel[:, :, : int(lens.max())], lengths=cnn, block=50)
        emb = frontend.projector.embed(hidden, 5)
    counts = [pooled_length(int(n), 5) for n in lens]
    assert counts == [300, 300, 50]
    ref = torch.cat([emb[i, :c] for i, c in enumerate(counts)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sessions_are_isolated_and_deterministic(frontend) -> None:
    a_pcm, b_pcm = _client_pcm(3, seed=6), _client_pcm(3, seed=7)
    alone = frontend.new_session()
    ref = [frontend.encode_unit(alone, c) for c in _wire_units(a_pcm, 2)]
    a, b = frontend.new_session(), frontend.new_session()
    for ca, cb, r in zip(_wire_units(a_pcm, 2), _wire_units(b_pcm, 2), ref, strict=True):
        frontend.encode_unit(b, cb)
        assert torch.equal(frontend.encode_unit(a, ca), r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_front_end_matches_cpu_and_runs_in_bf16() -> None:
    """Mel on the GPU (cuFFT) + encoder on the GPU == the CPU path; the bf16 path keeps 10 per unit."""
    import copy

    enc, proj = build(seed=13)
    cpu = AudioFrontEnd(enc, proj, tiny_audio())
    gpu = AudioFrontEnd(copy.deepcopy(enc).cuda(), copy.deepcopy(proj).cuda(), tiny_audio(), mel_device="cuda")
    half = AudioFrontEnd(copy.deepcopy(enc).cuda().bfloat16(), copy.deepcopy(proj).cuda().bfloat16(),
                         tiny_audio(), mel_device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # compare fp32 with fp32
    try:
        a, b, c = cpu.new_session(), gpu.new_session(), half.new_session()
        for chunk in _wire_units(_client_pcm(7, seed=8), 6):
            ref = cpu.encode_unit(a, chunk)
            torch.testing.assert_close(gpu.encode_unit(b, chunk).cpu(), ref, atol=1e-4, rtol=1e-4)
            low = half.encode_unit(c, chunk)
            assert low.dtype == torch.bfloat16 and low.shape == (10, 128)
            torch.testing.assert_close(low.float().cpu(), ref, atol=5e-2, rtol=5e-2)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
