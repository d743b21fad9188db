"""Batched audio front end (issue 15): one log-mel STFT over many windows and one streaming-encoder pass
over many sessions' units give what the per-session path gives, for sessions at different points of
their stream in the same batch: the first unit, both sides of the fixed/dynamic floor switch, the 30 s
window slide, and the audio-KV reset (model.md §2.2-§2.4). The sessions' audio KV and mel samples are slots
of two pools (a slot freed when its session's state is dropped, then reused); a session beyond the pools has
its own.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.audio import AudioFrontEnd, FloorMode, LogMel, MelStreamer, StreamConfig
from engine.audio.batched import forward_stream_batch
from engine.audio.frontend import AudioStreamState
from tests.engine.test_audio_encoder import build, tiny_audio

CFG = StreamConfig()
ATOL = 1e-5  # fp32: the batched path reorders reductions (padded keys, batched FFT plans)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pcm(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(n, generator=g)


def _unit_pcm(session: int, unit: int) -> torch.Tensor:
    n = CFG.first_chunk_samples - CFG.prefix_zeros if unit == 0 else CFG.chunk_samples
    return _pcm(1000 * session + unit, n)


@pytest.mark.parametrize("lengths", [(16_480, 64_560, 80_560, 480_560, 320_000), (401, 16_000)])
def test_logmel_batch_equals_one_window_at_a_time(lengths: tuple[int, ...]) -> None:
    mel = LogMel()
    windows = [_pcm(n, n) for n in lengths]
    modes = [FloorMode.FIXED if i % 2 else FloorMode.DYNAMIC for i in range(len(lengths))]
    for got, w, m in zip(mel.batch(windows, modes), windows, modes, strict=True):
        torch.testing.assert_close(got, mel(w, m), atol=ATOL, rtol=0)


@CUDA
def test_logmel_on_the_gpu_equals_the_cpu_path() -> None:
    windows = [_pcm(n, n) for n in (16_480, 80_560, 480_560)]
    modes = [FloorMode.FIXED, FloorMode.DYNAMIC, FloorMode.DYNAMIC]
    gpu, cpu = LogMel(device="cuda"), LogMel()
    for got, w, m in zip(gpu.batch(windows, modes), windows, modes, strict=True):  # cuFFT vs pocketfft: 1.1e-5 seen
        torch.testing.assert_close(got.cpu(), cpu(w, m), atol=2 * ATOL, rtol=0)


# Sessions brought to these next units, then stepped together: unit 0; unit 3 (last fixed floor) and
# 4 (first dynamic); unit 29 (window reaches 30 s: slide, and 29 x 50 + 52 >= 1500 frames: KV reset);
# unit 39 (second slide, no reset); unit 58 (second KV reset, no slide).
START_UNITS = (0, 3, 4, 29, 39, 58)


def _front_end(kv_slots: int = len(START_UNITS)) -> AudioFrontEnd:
    enc, proj = build(1500, seed=3)
    return AudioFrontEnd(enc, proj, tiny_audio(1500), kv_slots=kv_slots)


def _advanced(fe: AudioFrontEnd, session: int, units: int) -> AudioStreamState:
    state = fe.new_session()
    for k in range(units):
        fe.encode_unit(state, _unit_pcm(session, k))
    return state


def _facts(state: AudioStreamState) -> tuple:
    unit = state.last_unit
    assert unit is not None
    return (unit.unit, unit.floor, unit.base_sample, unit.buffer_samples, state.kv.length, state.kv.resets)


def test_batched_units_equal_per_session_units_at_every_stream_point() -> None:
    fe = _front_end()
    states = [_advanced(fe, i, k) for i, k in enumerate(START_UNITS)]
    assert fe.kv_pool is not None and fe.kv_pool.free == 0 and fe.kv_pool.holds([s.kv for s in states])
    assert fe.streamer.pool is not None and fe.streamer.pool.free == 0
    single, batched = copy.deepcopy(states), copy.deepcopy(states)  # each list: its own copy of the pools
    assert batched[0].kv.pool is not None and batched[0].kv.pool.holds([s.kv for s in batched])
    assert batched[0].mel.pool is not None and all(s.mel.pool is batched[0].mel.pool for s in batched)
    for step in range(3):  # the special units first, then two ordinary ones
        pcms = [_unit_pcm(i, k + step) for i, k in enumerate(START_UNITS)]
        want = [fe.encode_unit(s, p) for s, p in zip(single, pcms, strict=True)]
        got = fe.encode_units(batched, pcms)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=f"session at unit {START_UNITS[i] + step}")
        assert [_facts(s) for s in batched] == [_facts(s) for s in single]
        for b, s in zip(batched, single, strict=True):
            n = s.kv.length
            torch.testing.assert_close(b.kv.k[:, :, :, :n], s.kv.k[:, :, :, :n], atol=ATOL, rtol=0)
            torch.testing.assert_close(b.kv.v[:, :, :, :n], s.kv.v[:, :, :, :n], atol=ATOL, rtol=0)
        if step == 0:  # the batch really covered every case of the stream rule
            facts = {k: _facts(s) for k, s in zip(START_UNITS, batched, strict=True)}
            assert facts[3][1] is FloorMode.FIXED and facts[4][1] is FloorMode.DYNAMIC
            before = {k: _facts(s) for k, s in zip(START_UNITS, states, strict=True) if k}
            assert facts[29][2] > before[29][2] and facts[29][5] == before[29][5] + 1  # slide + reset
            assert facts[39][2] > before[39][2] and facts[39][5] == before[39][5]  # slide only
            assert facts[58][2] == before[58][2] and facts[58][5] == before[58][5] + 1  # reset only
            assert facts[0][0] == 0 and facts[0][4] == 50


def test_one_session_batch_equals_encode_unit() -> None:
    fe = _front_end()
    a, b = fe.new_session(), fe.new_session()
    pcm = _unit_pcm(7, 0)
    torch.testing.assert_close(fe.encode_units([b], [pcm])[0], fe.encode_unit(a, pcm), atol=ATOL, rtol=0)
    assert fe.encode_units([]) == []


def _step_and_compare(fe: AudioFrontEnd, batched: list[AudioStreamState], single: list[AudioStreamState],
                      pcms: list[torch.Tensor]) -> None:
    want = [fe.encode_unit(s, p) for s, p in zip(single, pcms, strict=True)]
    for g, w in zip(fe.encode_units(batched, pcms), want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert [_facts(s) for s in batched] == [_facts(s) for s in single]


def _gathers(fe: AudioFrontEnd, states: list[AudioStreamState], pcms: list[torch.Tensor]) -> tuple[list, int]:
    """encode_units(states, pcms) and how many `index_select` ops it dispatched (the KV window gather)."""

    class Gathers(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the mode's protocol
            Gathers.count += func is torch.ops.aten.index_select.default
            return func(*args, **(kwargs or {}))

    with Gathers(), torch.inference_mode():
        out = fe.encode_units(states, pcms)
    return out, Gathers.count


def test_a_run_of_pool_slots_reads_the_window_in_place_and_others_gather_it() -> None:
    """Sessions in slots 0, 1, 2 (one run): the encoder attends to a view of the pool, no gather; sessions in
    slots 0 and 2 gather their windows. Both equal the per-session path."""
    fe, solo = _front_end(kv_slots=3), _front_end(kv_slots=0)
    states = [_advanced(fe, i, 3 + 2 * i) for i in range(3)]
    singles = [_advanced(solo, i, 3 + 2 * i) for i in range(3)]
    assert [s.kv.slot for s in states] == [0, 1, 2]
    for k, pick in enumerate(([0, 1, 2], [0, 2], [1, 2])):
        pcms = [_unit_pcm(i, 20 + k) for i in pick]
        got, gathers = _gathers(fe, [states[i] for i in pick], pcms)
        want = [solo.encode_unit(singles[i], p) for i, p in zip(pick, pcms, strict=True)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        run = pick == list(range(pick[0], pick[0] + len(pick)))
        layers = 2 * len(fe.encoder.layers)  # K and V of every layer
        assert gathers == (0 if run else layers), (pick, gathers)


def test_a_dropped_session_frees_its_slot_and_the_next_session_reuses_it() -> None:
    """A slot keeps its last session's K/V; the session that reuses it must not see them (its own past only),
    next to a session deep in its stream (the padding mask), and through a §2.4 reset later on. A session
    that found no free slot works with its own cache and moves into a slot once one is free."""
    fe, solo = _front_end(kv_slots=2), _front_end(kv_slots=0)  # solo: private caches, per-session path
    old, deep = _advanced(fe, 1, 5), _advanced(fe, 2, 27)
    deep_solo = _advanced(solo, 2, 27)
    assert fe.kv_pool is not None and fe.kv_pool.free == 0
    beyond = fe.new_session()  # a third session: no slot left, a private cache
    assert beyond.kv.pool is None and fe.kv_pool.free == 0
    assert beyond.mel.pool is None and fe.streamer.pool is not None and fe.streamer.pool.free == 0
    slot, mel_slot = old.kv.slot, old.mel.slot
    del old
    gc.collect()  # (refcounting frees it already; a cycle would need a collection)
    assert fe.kv_pool.free == 1 and fe.streamer.pool.free == 1
    new = fe.new_session()  # its ring still holds `old`'s samples past its 560 prefix zeros: never read
    assert new.kv.slot == slot and new.kv.length == 0 and fe.kv_pool.free == 0
    assert new.mel.slot == mel_slot and new.mel.pool is fe.streamer.pool and fe.streamer.pool.free == 0
    new_solo = solo.new_session()
    for k in range(4):  # units 27.. of `deep`: its KV resets at unit 29 (29 x 50 + 52 >= 1500)
        _step_and_compare(fe, [new, deep], [new_solo, deep_solo], [_unit_pcm(3, k), _unit_pcm(2, 27 + k)])
    assert deep.kv.resets == 1 and new.kv.resets == 0
    beyond_solo = solo.new_session()  # a batch with the session beyond the pool: the per-session KV path
    for k in range(2):
        _step_and_compare(fe, [new, beyond, deep], [new_solo, beyond_solo, deep_solo],
                          [_unit_pcm(3, 4 + k), _unit_pcm(4, k), _unit_pcm(2, 31 + k)])
    assert beyond.kv.pool is None and beyond.mel.pool is None
    del new
    assert fe.kv_pool.free == 1 and fe.streamer.pool.free == 1
    for k in range(2):  # `beyond` moves into the freed slots, its 100 cached frames and its samples with it
        _step_and_compare(fe, [beyond, deep], [beyond_solo, deep_solo], [_unit_pcm(4, 2 + k), _unit_pcm(2, 33 + k)])
        assert beyond.kv.pool is fe.kv_pool and beyond.kv.slot == slot and fe.kv_pool.free == 0
        assert beyond.mel.pool is fe.streamer.pool and beyond.mel.slot == mel_slot and fe.streamer.pool.free == 0


def _mel_facts(unit) -> tuple:  # noqa: ANN001 - a UnitMel
    return (unit.unit, unit.frames, unit.prefix_extra, unit.suffix_extra, unit.floor, unit.buffer_samples,
            unit.base_sample)


def test_pooled_mel_windows_equal_windows_of_their_own() -> None:
    """The mel samples in a MelPool ring (written with one scatter, windows read with one gather, units cut
    with one) give the units the private windows give: the first unit with its 560 prefix zeros, both floors,
    the 30 s slides, and a ring that has wrapped (a session at unit 58 has received more than its capacity)."""
    pooled, private = MelStreamer(CFG, slots=len(START_UNITS)), MelStreamer(CFG)
    mine = [pooled.new_state() for _ in START_UNITS]
    theirs = [private.new_state() for _ in START_UNITS]
    assert pooled.pool is not None and all(s.pool is pooled.pool for s in mine) and theirs[0].pool is None
    for i, k in enumerate(START_UNITS):  # the per-session path on both
        for u in range(k):
            pooled.push(mine[i], _unit_pcm(i, u))
            private.push(theirs[i], _unit_pcm(i, u))
            torch.testing.assert_close(pooled.next_unit(mine[i]).mel, private.next_unit(theirs[i]).mel, atol=0, rtol=0)
    assert mine[-1].received > pooled.pool.capacity  # the ring wrapped
    for step in range(2):
        pcms = [_unit_pcm(i, k + step) for i, k in enumerate(START_UNITS)]
        pooled.push_many(mine, pcms)
        units, mels = pooled.next_units(mine)
        assert mels is not None and mels.shape == (len(mine), CFG.mel.n_mels, 104)
        for i, (state, unit, pcm) in enumerate(zip(theirs, units, pcms, strict=True)):
            private.push(state, pcm)
            want = private.next_unit(state)
            assert _mel_facts(unit) == _mel_facts(want)
            torch.testing.assert_close(unit.mel, want.mel, atol=ATOL, rtol=0)
            n = want.mel.shape[1]
            torch.testing.assert_close(mels[i, :, :n], want.mel, atol=ATOL, rtol=0)
            assert not mels[i, :, n:].any()  # a first unit's 102 frames, zero-padded to 104
    assert [s.base_sample for s in mine] == [s.base_sample for s in theirs]


def test_a_session_pushed_past_its_ring_leaves_the_pool() -> None:
    """PCM far ahead of the window (more than the ring holds) moves the session to samples of its own, with the
    same units; its slot stays taken until the state is dropped."""
    pooled, private = MelStreamer(CFG, slots=2), MelStreamer(CFG)
    a, b = pooled.new_state(), private.new_state()
    assert pooled.pool is not None
    pcm = _pcm(5, pooled.pool.capacity)  # 33 s at once
    pooled.push(a, pcm[:20_000])
    pooled.push(a, pcm[20_000:])
    private.push(b, pcm)
    assert a.pool is None and pooled.pool.free == 1
    for _ in range(3):
        torch.testing.assert_close(pooled.next_units([a])[0][0].mel, private.next_unit(b).mel, atol=ATOL, rtol=0)
    del a
    assert pooled.pool.free == 2


def _front_end_ops(sessions: int) -> int:
    """ATen ops of one whole `encode_units` (PCM push, mel windows, log-mel, encoder, projector) over `sessions`
    staggered sessions, every one in the pools."""
    fe = _front_end(kv_slots=sessions)
    states = [_advanced(fe, i, 2 + i % 3) for i in range(sessions)]
    pcms = [_unit_pcm(i, s.next_unit) for i, s in enumerate(states)]
    with _Ops() as ops:
        fe.encode_units(states, pcms)
    return ops.count


def test_the_pooled_front_end_dispatches_as_many_ops_for_six_sessions_as_for_two() -> None:
    """Not only the encoder: the sessions' PCM push, window advance and unit cut do not grow with the batch
    either (issue 15: about 9 ops a session before the mel pool)."""
    assert _front_end_ops(6) == _front_end_ops(2)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the mode's protocol
        self.count += 1
        return func(*args, **(kwargs or {}))


def _encoder_ops(fe: AudioFrontEnd, sessions: int) -> int:
    """ATen ops of one `forward_stream_batch` over `sessions` staggered sessions (after a first call)."""
    states = [_advanced(fe, i, 2 + i % 3) for i in range(sessions)]  # 100, 150, 200 cached frames
    units = [s.last_unit for s in states]  # (encoded again: only the op count matters here)
    forward_stream_batch(fe.encoder, units, [s.kv for s in states])
    with _Ops() as ops, torch.inference_mode():
        forward_stream_batch(fe.encoder, units, [s.kv for s in states])
    return ops.count


def test_the_pooled_encoder_pass_dispatches_as_many_ops_for_six_sessions_as_for_two() -> None:
    """The host work of the batched encoder does not grow with the batch (issue 15: per-session slices and
    stacks held the stage0 thread); with private caches it does."""
    assert _encoder_ops(_front_end(kv_slots=6), 6) == _encoder_ops(_front_end(kv_slots=2), 2)
    assert _encoder_ops(_front_end(kv_slots=0), 6) > _encoder_ops(_front_end(kv_slots=0), 2)


@CUDA
def test_batched_units_on_the_gpu_equal_the_cpu_path() -> None:
    cpu = _front_end()
    enc, proj = build(1500, seed=3)
    gpu = AudioFrontEnd(enc.cuda(), proj.cuda(), tiny_audio(1500), mel_device="cuda", kv_slots=3)
    states = [_advanced(cpu, i, k) for i, k in enumerate((0, 4, 29))]
    on_gpu = [gpu.new_session() for _ in states]  # the same stream points in the GPU front end's pool
    for g, s in zip(on_gpu, states, strict=True):  # each ring is indexed by stream sample: copied whole
        assert g.mel.pool is gpu.streamer.pool and s.mel.pool is cpu.streamer.pool
        g.mel.pool.data[g.mel.slot].copy_(s.mel.pool.data[s.mel.slot])
        g.mel.base_sample, g.mel.window_end, g.mel.unit, g.mel.received = (
            s.mel.base_sample, s.mel.window_end, s.mel.unit, s.mel.received)
        g.kv.k.copy_(s.kv.k)
        g.kv.v.copy_(s.kv.v)
        g.kv.length, g.kv.resets = s.kv.length, s.kv.resets
    pcms = [_unit_pcm(i, k) for i, k in enumerate((0, 4, 29))]
    want = [cpu.encode_unit(s, p) for s, p in zip(states, pcms, strict=True)]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # the CNN in fp32, not TF32 (8.5e-4 apart)
        got = gpu.encode_units(on_gpu, pcms)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4)  # TF32-free fp32, GPU reductions


@CUDA
def test_the_pooled_front_end_on_cuda_makes_no_hidden_sync() -> None:
    """tests/engine/test_stage0_syncs.py for the pool's gather / scatter and a session moving into a slot."""
    from tests.engine.test_stage0_syncs import _syncs_while

    enc, proj = build(1500, seed=3)
    fe = AudioFrontEnd(enc.cuda(), proj.cuda(), tiny_audio(1500), mel_device="cuda", kv_slots=3)
    states = [_advanced(fe, i, i) for i in range(3)]  # staggered: the padding mask
    beyond = _advanced(fe, 3, 1)  # a private cache
    fe.encode_units(states + [beyond], [_unit_pcm(i, s.next_unit) for i, s in enumerate(states + [beyond])])  # warm
    del states[0]
    gc.collect()

    def run() -> None:
        for _ in range(3):
            batch = states + [beyond]
            fe.encode_units(batch, [_unit_pcm(i, s.next_unit) for i, s in enumerate(batch)])

    assert _syncs_while(run) == []
    assert beyond.kv.pool is fe.kv_pool


def test_host_pcm_goes_to_the_mel_device_in_order() -> None:
    from engine.audio.frontend import _on_device

    pcms = [torch.arange(3.0), None, torch.arange(5.0, dtype=torch.float64), torch.zeros(2, device="meta")]
    moved = _on_device(pcms, torch.device("meta"))
    assert moved[1] is None and moved[3] is pcms[3]
    assert [tuple(m.shape) for m in (moved[0], moved[2])] == [(3,), (5,)]
    assert all(m.device.type == "meta" and m.dtype == torch.float32 for m in (moved[0], moved[2]))
    assert _on_device([torch.ones(2)], torch.device("cpu"))[0].device.type == "cpu"


def test_encoder_attention_on_cuda_avoids_the_kernels_with_the_measured_stalls() -> None:
    """CUDA: memory-efficient attention with math as the fallback (cuDNN attention stalled a masked batch for
    1.1 s on the H200); elsewhere PyTorch's own choice is left alone."""
    from engine.audio.batched import attention_kernels

    flags = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = [f() for f in flags]
    with attention_kernels(torch.device("cuda")):
        assert [f() for f in flags] == [False, False, True, True]
    assert [f() for f in flags] == before
    with attention_kernels(torch.device("cpu")):
        assert [f() for f in flags] == before
