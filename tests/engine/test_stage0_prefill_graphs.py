"""Graph sets (model.md §9.6 I10): unit-prefill and decode static steps against the eager forward.

On CPU the graph sets run in eager replay (same buckets, static buffers, copy-in/copy-out); the CUDA tests
capture real graphs, with and without torch.compile, and are skipped here.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.model.llm import Qwen3LLM, SlotKVCache
from engine.stage0 import DecodeRules, Stage0Config, TokenEvent, UnitDone
from engine.stage0.graphs import DecodeGraphs, GraphShapeError, PrefillGraphs
from engine.stage0.runner import ModelRunner, Row
from tests.engine.test_stage0_engine import by_session, make_engine, run_schedule
from tests.engine.test_stage0_helpers import TINY, tiny_llm

ATOL = 1e-5
# small slots and few buckets keep the number of captured shapes (and CPU time) low
SMALL = dict(eviction="off", max_context=1024, decode_kv_buckets=(256,), decode_batch_buckets=(1, 2, 4))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
tf32_advice = pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")  # inductor, fp32 matmuls


def _filled_kv(model: Qwen3LLM, device: str, lengths: dict[int, int], max_len: int = 96) -> SlotKVCache:
    kv = SlotKVCache.allocate(TINY, 4, max_len, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for slot, n in lengths.items():
            x = torch.randn(1, n, TINY.hidden_size, generator=gen).to(device)
            model(x, torch.arange(n, device=device)[None], torch.tensor([slot], device=device), kv)
    return kv


def _copy(kv: SlotKVCache) -> SlotKVCache:
    return SlotKVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v])


def _check_prefill(device: str, compile_mode: str | None = None, eager_replay: bool = False,
                   flex: bool = False) -> None:
    """The graph set against the eager forward (gathered KV, SDPA), one row at a time; with `flex` the graphs
    attend over the cache with FlexAttention instead."""
    model = tiny_llm().to(device)
    starts = {0: 5, 1: 40, 2: 17, 3: 9}
    kv = _filled_kv(model, device, starts)
    eager_kv = _copy(kv)
    graphs = PrefillGraphs.create(model, kv, (1, 2, 4), (2, 13, 20), (32,), compile_mode=compile_mode,
                                  eager_replay=eager_replay, flex=flex)
    assert graphs is not None and set(graphs.kv_buckets) == {32, kv.reserved_pos}  # every token's span
    assert graphs.flex_lengths == ({2, 13, 20} if flex else set())  # 20 > 16: flex's attention kernel, not decoding
    assert {key[2] for key in graphs.steps if key[1] == 13} == ({kv.reserved_pos} if flex else {32, kv.reserved_pos})
    gen = torch.Generator().manual_seed(1)
    # unit; merged close + unit, unit, close; a unit with a (tiny) frame beside a unit, in the 20 bucket
    for slots, lengths in (([1], [11]), ([2, 0, 3], [13, 11, 2]), ([3, 1], [20, 13])):
        embeds = [torch.randn(n, TINY.hidden_size, generator=gen).to(device) for n in lengths]
        got = graphs.run(slots, [starts[s] for s in slots], embeds)
        for slot, e, h in zip(slots, embeds, got, strict=True):  # eager reference, one row at a time
            with torch.no_grad():
                want = model(e[None], torch.arange(starts[slot], starts[slot] + e.shape[0], device=device)[None],
                             torch.tensor([slot], device=device), eager_kv)[0]
            torch.testing.assert_close(h, want, atol=ATOL, rtol=ATOL)
            starts[slot] += e.shape[0]
    for a, b in zip(kv.k + kv.v, eager_kv.k + eager_kv.v, strict=True):
        torch.testing.assert_close(a[:-1], b[:-1], atol=ATOL, rtol=ATOL)  # every slot but scratch


flex_unfused = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@flex_unfused
@pytest.mark.parametrize("flex", [False, True])
def test_prefill_eager_replay_equals_eager_forward(flex: bool) -> None:
    _check_prefill("cpu", eager_replay=True, flex=flex)


def test_decode_eager_replay_equals_eager_forward() -> None:
    model = tiny_llm()
    kv = _filled_kv(model, "cpu", {0: 5, 1: 17, 2: 30, 3: 9}, max_len=64)
    eager_kv = _copy(kv)
    graphs = DecodeGraphs.create(model, kv, (1, 2, 4), (32,), eager_replay=True)
    assert graphs is not None
    x = torch.randn(3, TINY.hidden_size, generator=torch.Generator().manual_seed(2))
    pos, slots = torch.tensor([17, 30, 5]), torch.tensor([1, 2, 0])
    got = graphs.run(x, pos, slots, reach=31)
    with torch.no_grad():
        want = model(x[:, None], pos[:, None], slots, eager_kv)[:, 0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    for a, b in zip(kv.k, eager_kv.k, strict=True):
        torch.testing.assert_close(a[:-1, :, :-1], b[:-1, :, :-1], atol=ATOL, rtol=ATOL)


def test_shape_drift_fails_loudly() -> None:
    model = tiny_llm()
    kv = SlotKVCache.allocate(TINY, 4, 64, dtype=torch.float32)
    prefill = PrefillGraphs.create(model, kv, (1, 2), (13,), (32,), eager_replay=True)
    decode = DecodeGraphs.create(model, kv, (1, 4), (32,), eager_replay=True)
    assert prefill is not None and decode is not None
    with pytest.raises(GraphShapeError):  # longer than the largest length bucket
        prefill.run([0], [0], [torch.zeros(14, TINY.hidden_size)])
    with pytest.raises(GraphShapeError):  # more rows than the largest batch bucket
        prefill.run([0, 1, 2], [0, 0, 0], [torch.zeros(3, TINY.hidden_size)] * 3)
    with pytest.raises(GraphShapeError):  # dtype drift
        prefill.run([0], [0], [torch.zeros(3, TINY.hidden_size, dtype=torch.float64)])
    with pytest.raises(GraphShapeError):
        decode.run(torch.zeros(1, TINY.hidden_size, dtype=torch.float64), torch.tensor([3]), torch.tensor([0]))
    assert not prefill.covers(1, 14) and not prefill.covers(3, 2) and prefill.covers(2, 13)


def _assert_rows_eager(runner: ModelRunner, step: list[Row], got: list[torch.Tensor], ref_kv: SlotKVCache) -> None:
    """Each row's hidden states = the eager forward of that row alone on `ref_kv` (which it advances)."""
    for r, h in zip(step, got, strict=True):
        x = runner.embed([r.token]) if r.embeds is None else r.embeds
        with torch.no_grad():
            want = runner.model(x[None], torch.arange(r.start, r.start + r.length)[None], torch.tensor([r.slot]),
                                ref_kv)[0]
        assert h.shape == want.shape
        torch.testing.assert_close(h, want, atol=ATOL, rtol=ATOL)


def test_runner_routes_rows_by_kind() -> None:
    """Decode rows, graphed unit rows (in chunks) and an eager prefix row in one call = each row eager."""
    engine, _ = make_engine(eager_replay_graphs=True, prefill_batch_buckets=(1, 2), **SMALL)
    runner = engine.runner
    assert runner.graphs is not None and runner.prefill_graphs is not None
    gen = torch.Generator().manual_seed(3)
    emb = [torch.randn(n, TINY.hidden_size, generator=gen) for n in (30, 20, 25, 12)]
    rows = [Row(s, 0, e) for s, e in enumerate(emb)]  # 30 > largest length bucket: eager
    runner.forward(rows)
    ref_kv = _copy(runner.kv)
    step = [Row(0, 30, token=7), Row(1, 20, torch.randn(13, TINY.hidden_size, generator=gen)),
            Row(2, 25, torch.randn(2, TINY.hidden_size, generator=gen)),
            Row(3, 12, torch.randn(11, TINY.hidden_size, generator=gen)),
            Row(4, 0, torch.randn(40, TINY.hidden_size, generator=gen))]
    got = runner.forward(step)
    _assert_rows_eager(runner, step, got, ref_kv)


def _count_replays(graphs: DecodeGraphs | PrefillGraphs) -> list[tuple[int, ...]]:
    """Wraps every static step's replay to record its key: which graph ran, and how often."""
    ran: list[tuple[int, ...]] = []
    for key, st in graphs.steps.items():
        def replay(key: tuple[int, ...] = key, inner: Callable[[], object] = st.replay) -> object:  # type: ignore[assignment]
            ran.append(key)
            return inner()
        st.replay = replay
    return ran


def test_runner_merges_decode_rows_into_the_prefill_pass() -> None:
    """mixed_step "merge": a step with unit rows runs its token rows in the same prefill graph (no decode replay),
    each row's hidden state still the eager forward's; past the largest batch bucket the split stays."""
    engine, _ = make_engine(eager_replay_graphs=True, prefill_batch_buckets=(2, 4), mixed_step="merge", **SMALL)
    runner = engine.runner
    assert runner.graphs is not None and runner.prefill_graphs is not None
    decode_ran, prefill_ran = _count_replays(runner.graphs), _count_replays(runner.prefill_graphs)
    gen = torch.Generator().manual_seed(5)
    runner.forward([Row(s, 0, torch.randn(n, TINY.hidden_size, generator=gen)) for s, n in enumerate((30, 20, 25, 12))])
    ref_kv = _copy(runner.kv)
    step = [Row(0, 30, token=7), Row(1, 20, torch.randn(13, TINY.hidden_size, generator=gen)), Row(2, 25, token=9),
            Row(3, 12, torch.randn(1, TINY.hidden_size, generator=gen))]
    decode_ran.clear(), prefill_ran.clear()
    got = runner.forward(step)
    assert decode_ran == [] and [k[:2] for k in prefill_ran] == [(4, 13)]  # one pass, 4 rows of up to 13
    _assert_rows_eager(runner, step, got, ref_kv)
    for a, b in zip(runner.kv.k + runner.kv.v, ref_kv.k + ref_kv.v, strict=True):  # keys where eager puts them
        torch.testing.assert_close(a[:-1], b[:-1], atol=ATOL, rtol=ATOL)  # every slot but scratch
    decode_ran.clear(), prefill_ran.clear()  # 2 unit rows + 3 token rows > 4: decode graph + prefill graph
    runner.forward([Row(0, 31, token=3), Row(2, 26, token=4), Row(4, 0, token=5),
                    Row(1, 33, torch.randn(13, TINY.hidden_size, generator=gen)),
                    Row(3, 13, torch.randn(13, TINY.hidden_size, generator=gen))])
    assert len(decode_ran) == 1 and [k[:2] for k in prefill_ran] == [(2, 13)]
    decode_ran.clear(), prefill_ran.clear()  # token rows alone: the decode graph
    runner.forward([Row(0, 32, token=3), Row(2, 27, token=4)])
    assert len(decode_ran) == 1 and prefill_ran == []


@flex_unfused
@pytest.mark.parametrize("prefill", ["gather", "flex"])
def test_engine_merging_decode_rows_equals_engine_splitting_them(prefill: str) -> None:
    """Same ids and hidden states, sessions staggered so that decode rows and unit prefills share steps."""
    model, arrivals, runs, decode_replays = tiny_llm(), {f"s{i}": 3 * i for i in range(4)}, [], []
    for merge in (False, True):
        engine, events = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1), **SMALL,
                                     prefill_attention=prefill, eager_replay_graphs=True,
                                     mixed_step="merge" if merge else "split")
        assert engine.runner.graphs is not None
        ran = _count_replays(engine.runner.graphs)
        run_schedule(engine, arrivals, units=4)
        decode_replays.append(len(ran))
        runs.append([by_session(events, sid) for sid in arrivals])
    assert decode_replays[1] < decode_replays[0]  # some token rows rode in a prefill pass
    for got, want in zip(runs[1], runs[0], strict=True):
        _assert_same_events(got, want)


def _engine_runs(model: Qwen3LLM, **cfg: object) -> list[list]:
    arrivals = {f"s{i}": 3 * i for i in range(4)}
    runs = []
    for graphs in (True, False):
        engine, events = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1), **SMALL,
                                     **cfg, eager_replay_graphs=graphs)
        if graphs:
            assert engine.runner.graphs is not None and engine.runner.prefill_graphs is not None
        run_schedule(engine, arrivals, units=4)
        runs.append(events)
    return [[by_session(run, sid) for sid in arrivals] for run in runs]


def _assert_same_events(got: list, want: list, atol: float = ATOL) -> None:
    def key(e: TokenEvent | UnitDone) -> tuple:
        return (type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator)

    assert [key(e) for e in got] == [key(e) for e in want]
    for a, b in zip(got, want, strict=True):
        if isinstance(a, TokenEvent) and a.hidden is not None:
            torch.testing.assert_close(a.hidden, b.hidden, atol=atol, rtol=atol)
    assert any(isinstance(e, UnitDone) for e in got)


@flex_unfused
@pytest.mark.parametrize(("merge", "prefill", "decode"), [(False, "gather", "matmul"), (True, "gather", "matmul"),
                                                          (True, "flex", "matmul"), (True, "flex", "flex")])
def test_engine_with_eager_replay_graphs_equals_eager_engine(merge: bool, prefill: str, decode: str) -> None:
    graphed, eager = _engine_runs(tiny_llm(), merge_unit_close=merge, prefill_attention=prefill,
                                  decode_attention=decode)
    for got, want in zip(graphed, eager, strict=True):
        _assert_same_events(got, want)


@flex_unfused
def test_flex_decode_engine_equals_matmul_decode_engine() -> None:
    """Decode steps with flex attention (each row its own key blocks, one span bucket for every batch bucket) give
    the matmul engine's ids and hidden states, graphs in eager replay; the default is matmul."""
    model, arrivals, runs = tiny_llm(), {f"s{i}": 3 * i for i in range(4)}, []
    for attention in ("matmul", "flex"):
        engine, events = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1), **SMALL,
                                     decode_attention=attention, eager_replay_graphs=True)
        graphs = engine.runner.graphs
        assert graphs is not None
        spans = {span for _, span in graphs.steps}
        assert spans == ({engine.runner.kv.reserved_pos} if attention == "flex" else {256, engine.runner.kv.reserved_pos})
        run_schedule(engine, arrivals, units=4)
        runs.append([by_session(events, sid) for sid in arrivals])
    for got, want in zip(runs[1], runs[0], strict=True):
        _assert_same_events(got, want)
    engine, _ = make_engine(model, sessions=2, **SMALL)
    assert engine.runner.decode_attention == "matmul"


def test_config_refuses_compile_modes_with_their_own_graphs() -> None:
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match="compile_mode"):
            Stage0Config(compile_mode=mode)
    assert Stage0Config().compile_mode is None and Stage0Config().prefill_lengths() == (2, 13, 79, 145)


def test_engine_compiles_before_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_mode compiles the decoder layer that the captured forwards run (a recording stand-in for
    torch.compile)."""
    calls: list[tuple] = []

    def fake_compile(run_layer: Callable[..., torch.Tensor], mode: str, dynamic: bool | None) -> object:
        def fn(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append((mode, dynamic))
            return run_layer(*args, **kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    engine, _ = make_engine(eager_replay_graphs=True, compile_mode="max-autotune-no-cudagraphs",
                            compile_dynamic=False, **{**SMALL, "decode_batch_buckets": (1,)},
                            prefill_batch_buckets=(1,))
    captured = len(calls)  # regional compilation: the compiled layer runs every layer of each captured step
    steps = len(engine.runner.graphs.steps) + len(engine.runner.prefill_graphs.steps)
    assert captured == steps * TINY.num_hidden_layers
    assert set(calls) == {("max-autotune-no-cudagraphs", False)}


@pytest.mark.slow
def test_compiled_prefill_eager_replay_equals_eager_forward() -> None:
    """torch.compile (inductor on CPU) inside the prefill graph set: one shape, so one compile."""
    model = tiny_llm()
    starts = {0: 5, 1: 40}
    kv = _filled_kv(model, "cpu", starts, max_len=64)
    eager_kv = _copy(kv)
    graphs = PrefillGraphs.create(model, kv, (2,), (13,), (kv.max_len,), compile_mode="default",
                                  eager_replay=True, compile_dynamic=False)
    assert graphs is not None and len(graphs.steps) == 1
    gen = torch.Generator().manual_seed(4)
    embeds = [torch.randn(n, TINY.hidden_size, generator=gen) for n in (13, 11)]
    got = graphs.run([1, 0], [starts[1], starts[0]], embeds)
    with torch.no_grad():
        for slot, e, h in zip((1, 0), embeds, got, strict=True):
            want = model(e[None], torch.arange(starts[slot], starts[slot] + e.shape[0])[None], torch.tensor([slot]),
                         eager_kv)[0]
            torch.testing.assert_close(h, want, atol=ATOL, rtol=ATOL)


# ---- CUDA (I10): real graphs, eager kernels and torch.compile ---------------------------------------------
@cuda
@tf32_advice
@pytest.mark.parametrize("flex", [False, True])
@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_cuda_prefill_graph_equals_eager(compile_mode: str | None, flex: bool) -> None:
    _check_prefill("cuda", compile_mode, flex=flex)


@cuda
@tf32_advice
@pytest.mark.parametrize("mixed_step", ["split", "merge", "shared"])
@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_cuda_engine_graphs_equal_eager_engine(compile_mode: str | None, mixed_step: str) -> None:
    """A step with token rows and unit prefills: two graphs (split), the (flex) prefill graph (merge), or one
    shared pass (shared)."""
    model = tiny_llm().cuda()
    arrivals = {f"s{i}": 3 * i for i in range(4)}
    runs = []
    for graphs in (True, False):
        engine, events = make_engine(model, sessions=4, rules=DecodeRules(force_listen_count=1), **SMALL,
                                     merge_unit_close=True, prefill_batch_buckets=(1, 4), use_cuda_graphs=graphs,
                                     compile_mode=compile_mode if graphs else None,
                                     mixed_step=mixed_step if graphs else "split")
        if graphs:
            assert engine.runner.graphs is not None and engine.runner.prefill_graphs is not None
        run_schedule(engine, arrivals, units=4)
        runs.append(events)
    for sid in arrivals:
        _assert_same_events(by_session(runs[0], sid), by_session(runs[1], sid), atol=1e-4)
