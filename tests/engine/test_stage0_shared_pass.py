"""A step's token rows and unit prefills in one pass over the weights (`Stage0Config.mixed_step = "shared"`).

The projections and the MLP take every row, each kind attends as it does alone: the token rows as in their decode
graph (dense bucket, span, kernel), the unit rows as in the prefill graph. On CPU in bf16 the hidden states are
bitwise those of the split step (two passes); in fp32 close (some CPUs' fp32 GEMM kernels depend on the row count:
2e-7 apart on one CI machine, bitwise on another); unlike "merge", whose token rows attend through the prefill
kernels and change a session's bf16 ids (tests/engine/test_stage0_bf16_batch.py). On the GPU at full size the
shared pass's token rows are bitwise split's only with every GEMM on one row count (`gemm_tile_rows`; without it
bench/RESULTS.md stop 36), which the h200 profiles set (stop 45).
"""

from __future__ import annotations

import pytest
import torch

from engine.model.llm import SlotKVCache
from engine.stage0 import DecodeRules
from engine.stage0.graphs import DecodeGraphs, PrefillGraphs, SharedGraphs
from tests.engine.test_stage0_bf16_batch import WATCHED, _tokens
from tests.engine.test_stage0_engine import by_session, make_engine, run_schedule
from tests.engine.test_stage0_helpers import TINY, tiny_llm

SMALL = dict(eviction="off", max_context=1024, decode_kv_buckets=(256,))
flex_unfused = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _filled(dtype: torch.dtype) -> tuple[torch.nn.Module, SlotKVCache]:
    model = tiny_llm().to(dtype)
    kv = SlotKVCache.allocate(TINY, 4, 96, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for slot, n in {0: 30, 1: 20, 2: 25, 3: 12}.items():
            model(torch.randn(1, n, TINY.hidden_size, generator=gen).to(dtype), torch.arange(n)[None],
                  torch.tensor([slot]), kv)
    return model, kv


def _copy(kv: SlotKVCache) -> SlotKVCache:
    return SlotKVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16: bit-equal; fp32: within 1e-6 (the row count may pick another CPU GEMM kernel, see the module doc)."""
    return torch.equal(a, b) if a.dtype == torch.bfloat16 else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _same_kv(a: SlotKVCache, b: SlotKVCache) -> bool:
    """Every slot but scratch, every position but the reserved one (idle dense rows write there, never read)."""
    return all(_same(x[:-1, :, :-1], y[:-1, :, :-1]) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))


@flex_unfused
@pytest.mark.parametrize("flex", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_shared_equals_forward_per_part(dtype: torch.dtype, flex: bool) -> None:
    model, kv = _filled(dtype)
    gen = torch.Generator().manual_seed(1)
    xu = torch.randn(2, 13, TINY.hidden_size, generator=gen).to(dtype)
    pos_u = torch.stack([torch.arange(20, 33), torch.arange(12, 25)])
    valid_u = torch.ones(2, 13, dtype=torch.bool)
    valid_u[1, 11:] = False  # an 11-position unit padded to 13
    slots_u = torch.tensor([1, 3])
    xd = torch.randn(4, 1, TINY.hidden_size, generator=gen).to(dtype)
    pos_d = torch.tensor([[30], [kv.reserved_pos], [25], [kv.reserved_pos]])  # tokens of slots 0, 2; 1, 3 idle
    ref = _copy(kv)
    with torch.no_grad():
        want_d = model(xd, pos_d, None, ref, kv_limit=64)  # the split step: decode, then prefill
        want_u = model(xu, pos_u, slots_u, ref, valid=valid_u, kv_limit=64, flex=flex)
        got = model.forward_shared(xu, pos_u, slots_u, valid_u, xd, pos_d, kv, limit_u=64, limit_d=64, flex=flex)
    hu, hd = got[:26].view(2, 13, -1), got[26:]
    assert _same(hd[[0, 2]], want_d[[0, 2], 0])
    assert _same(hu[0], want_u[0]) and _same(hu[1, :11], want_u[1, :11])
    assert _same_kv(kv, ref)


def _split_graphs(model: torch.nn.Module, kv: SlotKVCache, flex: bool = False) -> tuple[DecodeGraphs, PrefillGraphs]:
    """The decode and prefill graph sets a shared set takes its buckets from (eager replay)."""
    decode = DecodeGraphs.create(model, kv, (2, 4), (32, 64), eager_replay=True)
    prefill = PrefillGraphs.create(model, kv, (2, 4), (13,), (32, 64), eager_replay=True, flex=flex)
    assert decode is not None and prefill is not None
    return decode, prefill


@flex_unfused
@pytest.mark.parametrize("flex", [False, True])
def test_shared_graphs_equal_the_split_graphs(flex: bool) -> None:
    """Eager replay: one SharedGraphs run = a DecodeGraphs run then a PrefillGraphs run (fp32: `_same`), KV included;
    the dense bucket and the span are the decode graphs'."""
    model, kv = _filled(torch.float32)
    ref = _copy(kv)
    decode, prefill = _split_graphs(model, ref, flex)
    shared = SharedGraphs.create(*_split_graphs(model, kv, flex), 13, 4, eager_replay=True)
    assert shared is not None
    gen = torch.Generator().manual_seed(2)
    embeds = [torch.randn(n, TINY.hidden_size, generator=gen) for n in (13, 11)]
    x = torch.randn(2, TINY.hidden_size, generator=gen)
    pos, slots = torch.tensor([30, 25]), torch.tensor([0, 2])
    assert shared.covers(2, 13, 2) and not shared.covers(5, 13, 2) and not shared.covers(2, 14, 2)
    with torch.no_grad():
        want_d = decode.run(x, pos, slots, reach=31)
        want_u = prefill.run([1, 3], [20, 12], embeds)
        got_u, got_d = shared.run([1, 3], [20, 12], embeds, x, pos, slots)
    assert _same(got_d, want_d)
    assert all(_same(a, b) for a, b in zip(got_u, want_u, strict=True))
    assert _same_kv(kv, ref)


@pytest.mark.slow
@pytest.mark.parametrize("decode_attention", ["matmul", pytest.param("flex", marks=flex_unfused)])
def test_compiled_shared_graphs_equal_eager_ones(decode_attention: str) -> None:
    """The shared layer (tuple arguments, two layouts in one traced function) through torch.compile with symbolic
    sizes, as the GPU captures it (inductor on CPU here): the same hidden states as the eager shared pass. With
    flex decode attention the token rows leave the compiled layer for their kernel (a graph break)."""
    model, kv = _filled(torch.float32)
    model.decode_attention = decode_attention
    ref = _copy(kv)
    compiled = SharedGraphs.create(*_split_graphs(model, kv), 13, 4, eager_replay=True, compile_mode="default")
    eager = SharedGraphs.create(*_split_graphs(model, ref), 13, 4, eager_replay=True)
    assert compiled is not None and eager is not None and compiled.layer_fn is not None
    gen = torch.Generator().manual_seed(3)
    embeds = [torch.randn(n, TINY.hidden_size, generator=gen) for n in (13, 11)]
    x, pos, slots = torch.randn(2, TINY.hidden_size, generator=gen), torch.tensor([30, 25]), torch.tensor([0, 2])
    with torch.no_grad():
        got_u, got_d = compiled.run([1, 3], [20, 12], embeds, x, pos, slots)
        want_u, want_d = eager.run([1, 3], [20, 12], embeds, x, pos, slots)
    torch.testing.assert_close(got_d, want_d, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_u, want_u, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _count_runs(graphs: SharedGraphs) -> list[int]:
    ran, run = [0], graphs.run

    def counting(*args: object) -> object:
        ran[0] += 1
        return run(*args)

    graphs.run = counting  # type: ignore[method-assign]
    return ran


@flex_unfused
@pytest.mark.parametrize("prefill", ["gather", "flex"])
def test_engine_shared_equals_engine_split(prefill: str) -> None:
    """Staggered sessions, so token rows and unit prefills share steps: the same events and ids. Hidden states to
    1e-5, not bitwise: CPU fp32 matmuls of other row counts round differently (the bf16 check below is exact)."""
    model, arrivals, runs, shared_runs = tiny_llm(), {f"s{i}": 3 * i for i in range(4)}, [], []
    for mode in ("split", "shared"):
        engine, events = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1), **SMALL,
                                     prefill_attention=prefill, eager_replay_graphs=True, mixed_step=mode)
        sg = engine.runner.shared_graphs
        assert (sg is not None) is (mode == "shared")
        ran = _count_runs(sg) if sg is not None else [0]
        run_schedule(engine, arrivals, units=4)
        shared_runs.append(ran[0])
        runs.append([by_session(events, sid) for sid in arrivals])
    assert shared_runs[0] == 0 and shared_runs[1] > 0
    for got, want in zip(runs[1], runs[0], strict=True):
        assert [(type(e), e.unit_index, getattr(e, "token_id", None)) for e in got] == \
            [(type(e), e.unit_index, getattr(e, "token_id", None)) for e in want]
        for a, b in zip(got, want, strict=True):
            if getattr(a, "hidden", None) is not None:
                torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,tile", [("split", 0), ("shared", 128)])  # shared as the h200 profiles set it
def test_bf16_staggered_session_alone_equals_among_31_others_on_cpu(mode: str, tile: int) -> None:
    """The staggered bf16 check of test_stage0_bf16_batch.py on CPU (graphs in eager replay): with "shared" the
    watched session's token rows ride in the others' unit prefill passes and its ids are still those it draws
    alone (also with the h200 profiles' 128-row GEMM tiles)."""
    crowd, both = _tokens(list(range(32)), None, stagger=True, mode=mode, device="cpu", tile=tile)
    alone, _ = _tokens([WATCHED], None, stagger=True, mode=mode, device="cpu", tile=tile)
    assert (both >= 4) if mode == "shared" else both == 0  # a shared pass in each of the 4 units
    assert len(alone[WATCHED]) > 4 and alone[WATCHED] == crowd[WATCHED]


@flex_unfused
@pytest.mark.parametrize("tile", [0, 16])
def test_gemm_tile_rows_run_every_llm_gemm_at_the_tile(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemm_tile_rows`: every GEMM over the LLM's weights (decode graphs, unit prefills, shared passes, the
    lm_head) runs the tile's rows, or a multiple of them as one GEMM where the engine found that gives the tiles'
    bits (`verify_one_gemm_tiles`), so a token row in a shared pass gets its numbers from the kernel its decode pass
    uses (on the GPU the kernel follows the row count; bench/RESULTS.md stop 36). Off, the counts follow each
    step's rows."""
    model, rows, real = tiny_llm(), [], torch.nn.functional.linear
    weights = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.data_ptr() in weights:
            rows.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    engine, _ = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1), **SMALL,
                            eager_replay_graphs=True, mixed_step="shared", gemm_tile_rows=tile)
    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    assert engine.runner.shared_graphs is not None
    ran = _count_runs(engine.runner.shared_graphs)
    run_schedule(engine, {f"s{i}": 3 * i for i in range(4)}, units=4)
    assert ran[0] > 0 and len(rows) > 100
    if tile:  # multiples of the tile; more than one tile only as one GEMM verified to give the tiles' bits
        assert all(r % tile == 0 for r in rows) and max(rows) > tile
    else:
        assert len(set(rows)) > 2
