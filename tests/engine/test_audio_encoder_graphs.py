"""The batched audio encoder's captured steps (engine/audio/graphs.py): the same numbers as the per-session
front end at every stream point, for batches below their bucket (padding rows in the pool's scratch slot) and
over a span bucket longer than the batch's keys; sessions outside the batch keep their KV untouched. On the
CPU the steps replay eagerly over the same static inputs; on a GPU they are CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from engine.audio.graphs import EncoderGraphs, batch_buckets, span_buckets
from tests.engine.test_audio_frontend_batched import ATOL, START_UNITS, _advanced, _front_end, _unit_pcm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WATCHED = 5


def test_buckets_cover_the_pool() -> None:
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert span_buckets(1500) == (250, 500, 750, 1000, 1250, 1500)
    assert span_buckets(300) == (250, 300)


def test_the_pool_keeps_a_scratch_slot_no_session_takes() -> None:
    fe = _front_end(kv_slots=3)
    states = [fe.new_session() for _ in range(4)]
    pool = fe.kv_pool
    assert pool is not None and pool.slots == 3 and pool.k.shape[1] == 4 and pool.scratch == 3
    assert sorted(s.kv.slot for s in states[:3]) == [0, 1, 2] and states[3].kv.pool is None


def _runs(graphs: EncoderGraphs) -> list[tuple[int, int, bool]]:
    seen: list[tuple[int, int, bool]] = []
    run = graphs.run

    def counted(x: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, starts: torch.Tensor, span: int,
                whole: bool = False) -> torch.Tensor:
        seen.append((x.shape[0], span, whole))
        return run(x, slots, at, starts, span, whole)

    graphs.run = counted  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(("members", "slots"), [((0, 1, 2, 3, 4, 5), 8), ((1, 3, 5), 8), ((4,), 8),
                                               ((0, 1, 2, 3, 4, 5), 6)])
def test_graphed_batches_equal_per_session_units(members: tuple[int, ...], slots: int) -> None:
    """kv_slots 8: 6 sessions -> bucket 8, 3 -> 4, 1 -> 1; kv_slots 6: the whole pool in slot order, read in
    place; the others of the pool stay as they were."""
    ref, fe = _front_end(kv_slots=slots), _front_end(kv_slots=slots)
    fe.capture_graphs(eager_replay=True)
    assert fe.graphs is not None
    single = [_advanced(ref, i, k) for i, k in enumerate(START_UNITS)]
    batched = [_advanced(fe, i, k) for i, k in enumerate(START_UNITS)]
    runs = _runs(fe.graphs)
    others = [s for i, s in enumerate(batched) if i not in members]
    before = [(s.kv.k.clone(), s.kv.v.clone(), s.kv.length) for s in others]
    for step in range(2):
        pcms = [_unit_pcm(i, START_UNITS[i] + step) for i in members]
        want = [ref.encode_unit(single[i], p) for i, p in zip(members, pcms, strict=True)]
        got = fe.encode_units([batched[i] for i in members], pcms)
        for i, g, w in zip(members, got, want, strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=f"session at unit {START_UNITS[i] + step}")
            assert batched[i].kv.length == single[i].kv.length and batched[i].kv.resets == single[i].kv.resets
            n = single[i].kv.length
            torch.testing.assert_close(batched[i].kv.k[:, :, :, :n], single[i].kv.k[:, :, :, :n], atol=ATOL, rtol=0)
    assert [(n, whole) for n, _, whole in runs] == [(len(members), len(members) == slots)] * 2  # all captured
    for s, (k, v, n) in zip(others, before, strict=True):
        assert s.kv.length == n and torch.equal(s.kv.k, k) and torch.equal(s.kv.v, v)


def test_a_session_beyond_the_pool_runs_eagerly() -> None:
    fe = _front_end(kv_slots=2)
    fe.capture_graphs(eager_replay=True)
    assert fe.graphs is not None
    states = [fe.new_session() for _ in range(3)]
    runs = _runs(fe.graphs)
    fe.encode_units(states, [_unit_pcm(i, 0) for i in range(3)])
    assert states[2].kv.pool is None and runs == []
    fe.encode_units(states[:2], [_unit_pcm(i, 1) for i in range(2)])
    assert runs == [(2, 100, True)]


@CUDA
def test_cuda_graphed_front_end_equals_the_eager_one() -> None:
    from engine.audio import AudioFrontEnd
    from tests.engine.test_audio_encoder import build, tiny_audio

    def gpu_front_end() -> AudioFrontEnd:
        enc, proj = build(1500, seed=3)
        return AudioFrontEnd(enc.cuda(), proj.cuda(), tiny_audio(1500), mel_device="cuda", kv_slots=8)

    eager, graphed = gpu_front_end(), gpu_front_end()
    graphed.capture_graphs()
    units = (0, 4, 29)
    a = [_advanced(eager, i, k) for i, k in enumerate(units)]
    b = [_advanced(graphed, i, k) for i, k in enumerate(units)]
    assert graphed.graphs is not None and not graphed.graphs.eager_replay
    runs = _runs(graphed.graphs)
    for step in range(3):
        pcms = [_unit_pcm(i, k + step) for i, k in enumerate(units)]
        for g, w in zip(graphed.encode_units(b, pcms), eager.encode_units(a, pcms), strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert len(runs) == 3


@CUDA
@pytest.mark.parametrize("graphs", [False, True])
def test_bf16_front_end_alone_equals_among_31_others(graphs: bool) -> None:
    """A session's audio embeddings in bf16 do not depend on which sessions share its front-end batch (the
    stage0 invariant for the LLM, tests/engine/test_stage0_bf16_batch.py, for the audio path): the watched
    session alone and among 31 others, bitwise, over four units."""
    from engine.audio import AudioFrontEnd
    from tests.engine.test_audio_encoder import build, tiny_audio

    def run(members: list[int]) -> list[torch.Tensor]:
        enc, proj = build(1500, seed=3)
        fe = AudioFrontEnd(enc.cuda().to(torch.bfloat16), proj.cuda().to(torch.bfloat16), tiny_audio(1500),
                           mel_device="cuda", kv_slots=32)
        if graphs:
            fe.capture_graphs()
        states = {i: fe.new_session() for i in members}
        out = []
        for unit in range(4):
            got = fe.encode_units([states[i] for i in members], [_unit_pcm(i, unit) for i in members])
            out.append(got[members.index(WATCHED)].clone())
        return out

    crowd, alone = run(list(range(32))), run([WATCHED])
    for unit, (a, c) in enumerate(zip(alone, crowd, strict=True)):
        assert torch.equal(a, c), f"unit {unit}: max diff {(a.float() - c.float()).abs().max().item()}"
