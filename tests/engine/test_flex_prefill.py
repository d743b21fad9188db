"""Multi-token rows attending over the slot KV with FlexAttention (engine/model/flex.py, issue 16).

On CPU FlexAttention runs its eager reference, which applies the mask function everywhere and ignores the
block lists; so the block lists are checked here against the positions themselves, and the compiled kernel,
which reads only the listed blocks, against the gathered path on the GPU (tests/engine/test_stage0_prefill_graphs.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.flex import KV_BLOCK, Q_BLOCK, decode_splits, slot_blocks
from engine.model.llm import SlotKVCache
from tests.engine.test_stage0_helpers import TINY, tiny_llm

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _listed(blocks: torch.Tensor, counts: torch.Tensor, slot: int, qb: int) -> set[int]:
    return set(blocks[slot, 0, qb, :int(counts[slot, 0, qb])].tolist())


def test_each_slot_lists_exactly_the_key_blocks_its_queries_reach() -> None:
    """Rows at block edges, a row over two query blocks, padded queries, a dummy row and idle slots: every key
    at or before a query's position lies in a listed block, a full block lies wholly at or before every query
    of its query block, and no block past the last query's is listed."""
    slots, max_len, scratch = 6, 400, 5
    rows = [(0, 127, 13, 13), (1, 128, 11, 13), (2, 255, 2, 13), (3, 10, 150, 150)]  # slot, start, valid, T
    t = max(r[3] for r in rows)
    pos = torch.zeros(len(rows) + 1, t, dtype=torch.long)
    valid = torch.zeros(len(rows) + 1, t, dtype=torch.bool)
    for i, (_, start, k, _) in enumerate(rows):
        pos[i, :k], valid[i, :k] = torch.arange(start, start + k), True
    slot_ids = torch.tensor([r[0] for r in rows] + [scratch])  # the last row is a dummy row
    write_pos = torch.where(valid, pos, 0)
    mask = slot_blocks(write_pos, valid, slot_ids, slots, max_len).block_mask
    for slot in range(slots):
        row = next((i for i, r in enumerate(rows) if r[0] == slot), None)
        for qb in range(-(-t // Q_BLOCK)):
            partial = _listed(mask.kv_indices, mask.kv_num_blocks, slot, qb)
            full = _listed(mask.full_kv_indices, mask.full_kv_num_blocks, slot, qb)
            if row is None:
                want = set() if slot != scratch else {0}  # idle: nothing; the dummy row: block 0 (discarded)
                assert partial | full == want and not full, slot
                continue
            _, start, k, _ = rows[row]
            qpos = [p for p in range(start, start + k) if qb * Q_BLOCK <= p - start < (qb + 1) * Q_BLOCK]
            first = min(qpos) if qpos else start  # a padded query attends as the row's first one
            last = max(qpos) if qpos else start
            assert not (partial & full)
            assert partial | full == set(range(last // KV_BLOCK + 1)), (slot, qb)
            assert all((b + 1) * KV_BLOCK - 1 <= first for b in full), (slot, qb)
            assert len(full) == (first + 1) // KV_BLOCK  # every block that could be full is


def test_flex_rows_equal_the_gathered_rows() -> None:
    """The same ragged forwards (prefixes over several query blocks, then a padded batch of unit rows at block
    edges with a dummy row) through flex and through the gathered copy: same hidden states and caches."""
    model = tiny_llm()
    runs = []
    for flex in (False, True):
        kv = SlotKVCache.allocate(TINY, 6, 400, dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        out = []
        with torch.no_grad():
            for slot, n in ((0, 127), (2, 260), (5, 128)):
                x = torch.randn(1, n, TINY.hidden_size, generator=gen)
                out.append(model(x, torch.arange(n)[None], torch.tensor([slot]), kv, flex=flex)[0])
            starts, lengths, t = [127, 260, 128], [13, 11, 2], 13
            x = torch.randn(4, t, TINY.hidden_size, generator=gen)
            pos = torch.zeros(4, t, dtype=torch.long)
            valid = torch.zeros(4, t, dtype=torch.bool)
            for i, (s, k) in enumerate(zip(starts, lengths, strict=True)):
                pos[i, :k], valid[i, :k] = torch.arange(s, s + k), True
            h = model(x, pos, torch.tensor([0, 2, 5, kv.scratch]), kv, valid=valid, kv_limit=288, flex=flex)
            out += [h[i, :k] for i, k in enumerate(lengths)]
        runs.append((out, kv))
    (gathered, kv_g), (flexed, kv_f) = runs
    for a, b in zip(gathered, flexed, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for a, b in zip(kv_g.k + kv_g.v, kv_f.k + kv_f.v, strict=True):
        torch.testing.assert_close(b[:-1], a[:-1], atol=1e-5, rtol=1e-5)  # every slot but scratch


def test_flex_decode_rows_equal_matmul_decode_rows() -> None:
    """Single-token rows in the dense layout (row i = slot i), one of them idle at the reserved position: flex
    (each row its own key blocks) == the matmul attention over the batch's span, for the live rows."""
    model = tiny_llm()
    outs = []
    for attention in ("matmul", "flex"):
        model.decode_attention = attention
        kv = SlotKVCache.allocate(TINY, 4, 400, dtype=torch.float32)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for slot, n in ((0, 127), (1, 300), (3, 5)):
                x = torch.randn(1, n, TINY.hidden_size, generator=gen)
                model(x, torch.arange(n)[None], torch.tensor([slot]), kv)
            pos = torch.tensor([[127], [300], [kv.reserved_pos], [5]])  # slot 2 idle
            x = torch.randn(4, 1, TINY.hidden_size, generator=gen)
            outs.append(model(x, pos, None, kv, kv_limit=kv.reserved_pos + 1)[[0, 1, 3], 0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def _decode_setup(model: torch.nn.Module, slots: int) -> tuple[SlotKVCache, torch.Tensor, torch.Tensor]:
    """A cache of `slots` sessions, slots 0 and 1 filled; two dense decode rows at their next positions."""
    kv = SlotKVCache.allocate(TINY, slots, 200, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for slot, n in ((0, 150), (1, 40)):
            model(torch.randn(1, n, TINY.hidden_size, generator=gen), torch.arange(n)[None], torch.tensor([slot]), kv)
    return kv, torch.randn(2, TINY.hidden_size, generator=gen), torch.tensor([150, 40])


def test_flex_decode_runs_over_the_rows_own_slots_not_the_whole_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense rows 0..B-1 (= slots 0..B-1): the kernel's batch is B over the cache's first B slots, however many
    slots the cache has (over all of them, a row among idle slots cost 3x its attention: bench/RESULTS.md stop 48),
    with the same outputs."""
    import engine.model.flex as flex

    model = tiny_llm()
    model.decode_attention = "flex"
    seen: list[tuple[int, int]] = []
    real = flex.flex_attention
    monkeypatch.setattr(flex, "flex_attention", lambda q, k, v, **kw: seen.append((q.shape[0], k.shape[0]))
                        or real(q, k, v, **kw))
    outs = []
    for slots in (2, 7):
        kv, x, pos = _decode_setup(model, slots)
        seen.clear()
        with torch.no_grad():
            outs.append(model(x[:, None], pos[:, None], None, kv, kv_limit=kv.reserved_pos + 1)[:, 0])
        assert seen == [(2, 2)] * TINY.num_hidden_layers
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")
def test_compiled_flex_decode_graphs_equal_the_eager_model() -> None:
    """The decode graphs' compiled layer with symbolic sizes (inductor on CPU, replayed eagerly) around the dense
    flex op (`duplex::dense_flex_decode`, opaque to the compile): the eager model's hidden states."""
    from engine.stage0.graphs import DecodeGraphs

    model = tiny_llm()
    model.decode_attention = "flex"
    kv, x, pos = _decode_setup(model, 5)
    ref = SlotKVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v])
    graphs = DecodeGraphs.create(model, kv, (2, 4), (256,), eager_replay=True, compile_mode="default")
    assert graphs is not None and graphs.layer_fn is not None
    got = graphs.run(x, pos, torch.tensor([0, 1]), reach=151).clone()
    with torch.no_grad():
        want = model(x[:, None], pos[:, None], None, ref, kv_limit=ref.reserved_pos + 1)[:, 0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_standalone_compiled_flex_compiles_every_shape_past_dynamos_limit() -> None:
    """Outside a compiled region the flex kernel is compiled once per shape (`compiled_flex_attention`): a process
    with more shapes than dynamo's default recompile limit (8) still compiles each, where a bare
    `torch.compile(flex_attention)` would run the eager reference (other numerics) from the 9th shape on."""
    import torch._dynamo as dynamo
    import torch.nn.functional as F

    from engine.model.flex import compiled_flex_attention

    k = torch.randn(1, 2, 32, 8)
    shapes = 10
    # dynamo's default limit; an engine built earlier in this process may have raised the global one
    with dynamo.config.patch(recompile_limit=8):
        before = dynamo.utils.counters["frames"]["ok"]
        for t in range(1, shapes + 1):
            q = torch.randn(1, 2, 16 * t, 8)
            torch.testing.assert_close(compiled_flex_attention(q, k, k), F.scaled_dot_product_attention(q, k, k))
        # one compiled frame per shape (a bare compile: 8 of 10, then "Dynamo recompile limit exceeded")
        assert dynamo.utils.counters["frames"]["ok"] - before == shapes
        assert dynamo.config.recompile_limit == 8  # the patch is local to the call


def test_decode_splits_follow_the_split_length_and_zero_leaves_torchs_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flex decoding kernel's SPLIT_KV: one split per `keys_per_split` keys of a cache row (at least one), None
    (torch's own count) for 0 and off CUDA, where eager flex takes no kernel options; for 0 with the rows given
    (decode rows: the whole cache's slots x kv heads) torch's count for those rows, whatever the batch."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing is allocated
    assert decode_splits(8200, cuda) == 17  # the default split, 512 keys
    assert decode_splits(8200, cuda, 4096) == 3 and decode_splits(100, cuda, 4096) == 1
    assert decode_splits(8200, cuda, 0) is None and decode_splits(8200, cpu) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert decode_splits(8200, cuda, 0, rows=2 * 8) == 16 and decode_splits(8200, cuda, 0, rows=33 * 8) == 1
    assert decode_splits(8200, cuda, 512, rows=2 * 8) == 17 and decode_splits(8200, cpu, 0, rows=16) is None


def test_the_models_split_lengths_reach_their_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Qwen3LLM.flex_prefill_keys_per_split` and `flex_keys_per_split` (stage0's engine options) are the split
    lengths of the blocks its forward builds for unit rows (gathered) and flex decode rows (dense)."""
    import engine.model.llm as llm

    seen: list[int] = []
    for name in ("slot_blocks", "dense_blocks"):
        real = getattr(llm, name)
        monkeypatch.setattr(llm, name, lambda *a, _real=real, **k: seen.append(a[-1]) or _real(*a, **k))
    model = tiny_llm()
    model.flex_keys_per_split, model.flex_prefill_keys_per_split = 16, 32
    kv = SlotKVCache.allocate(TINY, 2, 64, dtype=torch.float32)
    model._attention(torch.arange(3)[None].expand(2, 3), torch.tensor([0, 1]), kv, None, None, True, "matmul",
                     torch.float32)
    model._attention(torch.tensor([[4], [5]]), None, kv, None, None, False, "flex", torch.float32)
    assert seen == [32, 16]


def test_the_unit_kernels_tuning_reaches_the_flex_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Qwen3LLM.flex_prefill_warps` / `flex_prefill_stages` (stage0's engine options) become the unit blocks'
    tuning on CUDA (none elsewhere: eager flex takes no kernel options), and `flex_slot_attend` hands them to the
    decoding kernel beside the split; rows of more than 16 positions (the flex attention kernel) never get them."""
    from engine.model import flex

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flex.decode_tuning(4, 2, cuda) == (("num_warps", 4), ("num_stages", 2))
    assert flex.decode_tuning(0, 3, cuda) == (("num_stages", 3),) and flex.decode_tuning(0, 0, cuda) == ()
    assert flex.decode_tuning(4, 2, cpu) == ()
    import engine.model.llm as llm

    seen: list[tuple] = []
    monkeypatch.setattr(llm, "decode_tuning", lambda w, s, d: seen.append((w, s, d.type)) or (("num_warps", w),))
    model = tiny_llm()
    model.flex_prefill_warps, model.flex_prefill_stages = 4, 2
    kv = SlotKVCache.allocate(TINY, 2, 64, dtype=torch.float32)
    _, _, blocks = model._attention(torch.arange(3)[None].expand(2, 3), torch.tensor([0, 1]), kv, None, None, True,
                                    "matmul", torch.float32)
    assert seen == [(4, 2, "cpu")] and blocks.tuning == (("num_warps", 4),)
    calls: list[object] = []
    monkeypatch.setattr(flex, "flex_attention", lambda *a, **k: calls.append(k["kernel_options"]) or a[0])
    for t in (3, 17):
        q = torch.zeros(1, 4, t, 8)
        blocks = flex.SlotBlocks(None, torch.tensor([0]), split_kv=5,  # type: ignore[arg-type]
                                 tuning=(("num_warps", 4), ("num_stages", 2)))
        flex.flex_slot_attend(q, torch.zeros(2, 2, 32, 8), torch.zeros(2, 2, 32, 8), blocks)
    assert calls == [{"num_warps": 4, "num_stages": 2, "SPLIT_KV": 5}, {"FORCE_USE_FLEX_ATTENTION": True}]
