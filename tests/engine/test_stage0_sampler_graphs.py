"""The sampler's graphs (engine/stage0/sampler_graphs.py): a replay gives the eager sampler's ids, draws and flags
at every batch size up to the largest bucket (the dummy rows change no live row), with the rows' repetition
histories read from the ring; a ring that grows turns the graphs off; the engine samples through them and its
sessions' output is the eager engine's. On CPU the graphs replay eagerly; on CUDA they are real graphs."""

from __future__ import annotations

import pytest
import torch

from engine.stage0 import DecodeRules, Fence, TokenEvent, UnitDone
from engine.stage0.penalty import HistoryRing
from engine.stage0.sampler_graphs import SamplerGraphs
from engine.stage0.sampling import (
    SamplerIds,
    SamplingBatch,
    SamplingParams,
    UniformStream,
    sample,
    table_rows,
)
from tests.engine.test_stage0_engine import by_session, make_engine
from tests.engine.test_stage0_helpers import tiny_ids, tiny_llm, unit_pcm

V = 320
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
# every rule of §3.5: sampled, greedy, narrow top-k/top-p, the listen early return, a top-k wider than the
# candidates (the row the caller draws again), a strong penalty
PARAMS = [SamplingParams(), SamplingParams(greedy=True), SamplingParams(temperature=1.3, top_k=5, top_p=0.5),
          SamplingParams(listen_top_k=300), SamplingParams(top_k=100, top_p=1.0),
          SamplingParams(repetition_penalty=1.5, top_k=40, top_p=0.95)]


class Owner:
    """A session stand-in: the ring holds its owner weakly."""


def _ids() -> SamplerIds:
    s = tiny_ids()
    return SamplerIds(chunk_eos=s.chunk_eos, turn_eos=s.turn_eos, listen_bias=s.listen,
                      masked=(s.tts_pad, *s.bad_token_ids, s.chunk_eos))


@pytest.mark.parametrize("device", DEVICES)
def test_replay_equals_the_eager_sampler_at_every_batch_size(device: str) -> None:
    ids, dev = _ids(), torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ring = HistoryRing(8, SamplingParams().repetition_window, V, dev)  # as the engine's: no row's window grows it
    graphs = SamplerGraphs.create(ring, ids, V, dtype, (2, 4, 8), eager_replay=dev.type != "cuda")
    assert graphs is not None and sorted(graphs.steps) == [2, 4, 8]
    g = torch.Generator().manual_seed(0)
    owners = [Owner() for _ in range(8)]
    inexact = 0
    for n in range(1, 9):
        for trial in range(3):
            slots = torch.randperm(8, generator=g)[:n].tolist()
            params = [PARAMS[(i + trial) % len(PARAMS)] for i in range(n)]
            histories = [torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
                         for _ in range(n)]
            ring.sync([(s, owners[s], h, p.repetition_window) for s, h, p in zip(slots, histories, params,
                                                                                strict=True)])
            uniforms = [UniformStream(100 * n + 10 * trial + i).peek(2) for i in range(n)]
            logits = (torch.randn(n, V, generator=g) * 3).to(dev, dtype)
            logits[::3, ids.chunk_eos] = 9.0  # Step A ends some rows
            want = torch.stack(sample(logits, SamplingBatch.from_ring(params, uniforms, ring, slots, dev), ids)).long()
            counts = [ring.count[s] for s in slots]
            assert graphs.covers(n)
            got, ring_slots, count = graphs.run(logits, table_rows(params, uniforms, slots, counts))
            assert torch.equal(got, want), (n, trial)
            assert ring_slots.tolist() == slots and count.tolist() == counts
            inexact += int((got[3] == 0).sum())
    assert inexact > 0  # the wide top-k rows came back flagged for the eager redraw


def test_a_grown_ring_turns_the_graphs_off() -> None:
    ring = HistoryRing(4, 16, V, "cpu")
    graphs = SamplerGraphs.create(ring, _ids(), V, torch.float32, (2, 4), eager_replay=True)
    assert graphs is not None and graphs.covers(4) and not graphs.covers(5)
    ring.sync([(0, Owner(), list(range(40)), 32)])  # a window wider than the ring: it grows (a new tensor)
    assert ring.capacity == 32 and not graphs.covers(2)


def test_no_graphs_unless_enabled_or_on_cuda() -> None:
    ring = HistoryRing(4, 16, V, "cpu")
    assert SamplerGraphs.create(ring, _ids(), V, torch.float32, (2, 4)) is None  # CPU, no eager replay
    assert SamplerGraphs.create(ring, _ids(), V, torch.float32, (2, 4), enabled=False, eager_replay=True) is None


def _run(graphs: bool, monkeypatch: pytest.MonkeyPatch, **cfg) -> tuple[list, int]:
    runs = []
    real = SamplerGraphs.run
    monkeypatch.setattr(SamplerGraphs, "run", lambda self, *a: runs.append(1) or real(self, *a))
    engine, events = make_engine(tiny_llm(), sessions=4, rules=DecodeRules(force_listen_count=1),
                                 eager_replay_graphs=graphs, decode_batch_buckets=(2, 4), **cfg)
    assert (engine.scheduler.sampler_graphs is not None) == graphs
    sids = [f"s{i}" for i in range(4)]
    for i, sid in enumerate(sids):  # top-k within the candidates: the graphs' draws are the ones kept
        engine.open(sid, Fence(1, 0), params=SamplingParams(seed=i, temperature=1.5, top_k=40, top_p=0.95))
    sent = dict.fromkeys(sids, 0)
    for k in range(8):
        for sid in sids[:2 + k % 3]:  # batches of 2, 3 and 4 rows
            engine.append(sid, Fence(1, 0, seq=sent[sid]), unit_pcm(int(sid[1:]), sent[sid]))
            sent[sid] += 1
        engine.run_until_idle()
    return events, len(runs)


@pytest.mark.parametrize("scripted", [False, True])
def test_the_engine_samples_through_the_graphs_as_it_would_eagerly(monkeypatch: pytest.MonkeyPatch,
                                                                    scripted: bool) -> None:
    cfg = dict(scripted_decisions=True, benchmark_mode=True) if scripted else {}
    graphed, replays = _run(True, monkeypatch, **cfg)
    eager, none = _run(False, monkeypatch, **cfg)
    assert replays > 5 and none == 0
    tokens = 0
    for sid in ("s0", "s1", "s2", "s3"):
        got, want = by_session(graphed, sid), by_session(eager, sid)
        key = [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in got]
        assert key == [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator)
                       for e in want]
        assert any(isinstance(e, UnitDone) for e in got)
        tokens += sum(isinstance(e, TokenEvent) for e in got)
    assert tokens > 20
