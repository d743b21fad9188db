"""Stage0 engine on the tiny model: plumbing vs an offline forward (I5/I12), batched == solo (I6/I9)."""

from __future__ import annotations

import torch

from engine.model.llm import SlotKVCache
from engine.stage0 import DecodeRules, Fence, SamplingParams, Stage0Config, Stage0Engine, TokenEvent, UnitDone
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer, unit_pcm

ATOL = 1e-5


def make_engine(model=None, sessions: int = 8, rules: DecodeRules = DecodeRules(force_listen_count=0),  # noqa: B008 - frozen
                **cfg) -> tuple[Stage0Engine, list]:
    events: list = []
    config = Stage0Config(max_sessions=sessions, **{"use_cuda_graphs": False, **cfg})
    engine = Stage0Engine(model or tiny_llm(), tiny_tokenizer(), FakeFrontEnd(), events.append, config, rules)
    return engine, events


def params(seed: int) -> SamplingParams:
    # a high temperature on random weights gives a mix of listen, speak and long units
    return SamplingParams(seed=seed, temperature=1.5, top_k=320, top_p=1.0)


def fed_sequence(engine: Stage0Engine, sid: str, events: list,
                 units: set[int] | None = None) -> tuple[torch.Tensor, list[tuple[int, TokenEvent]]]:
    """Rebuilds the session's input embeddings from its events (optionally only `units`); returns them and
    (position, event) pairs."""
    s = engine.session(sid)
    parts = [engine.prefix.embeds(s.prompt, s.ref_audio)]
    n = parts[0].shape[0]
    located = []
    emb = engine.runner.embed
    for done in [e for e in events if isinstance(e, UnitDone) and e.session_id == sid
                 and (units is None or e.unit_index in units)]:
        toks = [e for e in events if isinstance(e, TokenEvent) and e.session_id == sid
                and e.unit_index == done.unit_index and e.hidden is not None]
        unit = [emb([engine.ids.unit_open]), s.frontend_state["units"][done.unit_index]]
        n += 11
        for e in toks:
            located.append((n, e))
            unit.append(emb([e.token_id]))
            n += 1
        unit.append(emb([done.terminator, engine.ids.unit_close]))
        n += 2
        parts += unit
    return torch.cat(parts), located


def offline_hidden(engine: Stage0Engine, seq: torch.Tensor) -> torch.Tensor:
    kv = SlotKVCache.allocate(engine.model.cfg, 1, seq.shape[0], dtype=torch.float32)
    with torch.no_grad():
        return engine.model(seq[None], torch.arange(seq.shape[0])[None], torch.tensor([0]), kv)[0]


def test_session_matches_offline_forward_and_accounting() -> None:
    """The separate close (the merged one: test_stage0_merge.py)."""
    engine, events = make_engine(rules=DecodeRules(force_listen_count=1), merge_unit_close=False)
    engine.open("a", Fence(1, 0), params=params(3))
    engine.run_until_idle()
    prefix = engine.session("a").cached_len
    assert prefix == engine.session("a").prefix_len > 0
    for k in range(5):
        engine.append("a", Fence(1, 0, seq=k), unit_pcm(1, k))
        before = engine.session("a").cached_len
        engine.run_until_idle()
        done = [e for e in events if isinstance(e, UnitDone)][-1]
        fed = [e for e in events if isinstance(e, TokenEvent) and e.unit_index == k and e.hidden is not None]
        assert engine.session("a").cached_len == before + 13 + len(fed)  # I12
        assert done.metrics.tokens >= 1 and done.metrics.ttft_s >= done.metrics.queue_s >= 0
        if k == 0:
            assert done.is_listen and fed == []  # force_listen_count = 1
        if not done.is_listen:
            assert [r.token_id for r in done.rows] == [e.token_id for e in fed if e.j >= 1]
    s = engine.session("a")
    assert sum(r.span for r in s.ledger) == s.cached_len - s.prefix_len
    seq, located = fed_sequence(engine, "a", events)
    assert seq.shape[0] == s.cached_len and located
    ref = offline_hidden(engine, seq)
    for pos, e in located:
        torch.testing.assert_close(e.hidden, ref[pos], atol=ATOL, rtol=ATOL)


def run_schedule(engine: Stage0Engine, arrivals: dict[str, int], units: int) -> None:
    """Session i opens at step arrivals[i] and appends a unit every 7 steps (staggered)."""
    step, pending = 0, {sid: 0 for sid in arrivals}
    while True:
        for sid, start in arrivals.items():
            if step == start:
                engine.open(sid, Fence(1, 0), params=params(int(sid[1:])))
            k = pending[sid]
            if step >= start and k < units and (step - start) % 7 == 0:
                engine.append(sid, Fence(1, 0, seq=k), unit_pcm(int(sid[1:]), k))
                pending[sid] += 1
        busy = engine.step()
        step += 1
        if not busy and all(v == units for v in pending.values()) and step > max(arrivals.values()):
            return


def by_session(events: list, sid: str) -> list:
    return [e for e in events if e.session_id == sid]


def test_batched_equals_solo_for_eight_staggered_sessions() -> None:
    model = tiny_llm()
    arrivals = {f"s{i}": 3 * i for i in range(8)}
    rules = DecodeRules(force_listen_count=1)  # unit 0 of each session is a listen unit
    engine, events = make_engine(model, rules=rules)
    run_schedule(engine, arrivals, units=4)
    speak_units = 0
    for sid in arrivals:
        solo, solo_events = make_engine(model, sessions=1, rules=rules)
        run_schedule(solo, {sid: 0}, units=4)
        got, want = by_session(events, sid), by_session(solo_events, sid)
        assert [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in got] == \
            [(type(e), e.unit_index, e.token_id if isinstance(e, TokenEvent) else e.terminator) for e in want]
        for a, b in zip(got, want, strict=True):
            if isinstance(a, TokenEvent) and a.hidden is not None:
                torch.testing.assert_close(a.hidden, b.hidden, atol=ATOL, rtol=ATOL)
        assert engine.session(sid).history == solo.session(sid).history
        speak_units += sum(1 for e in got if isinstance(e, UnitDone) and not e.is_listen)
    assert speak_units > 0  # the schedule exercised decode rows, not only listen units


def test_serve_thread_processes_appends() -> None:
    import threading

    engine, events = make_engine(rules=DecodeRules(force_listen_count=1))
    stop = threading.Event()
    worker = threading.Thread(target=engine.serve, args=(stop,), daemon=True)
    worker.start()
    try:
        engine.open("a", Fence(1, 0))
        engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0))
        for _ in range(400):
            if any(isinstance(e, UnitDone) for e in events):
                break
            threading.Event().wait(0.01)
    finally:
        stop.set()
        worker.join(timeout=5)
    assert [e for e in events if isinstance(e, UnitDone)][0].is_listen


def test_each_step_says_whether_it_ran_a_prefill() -> None:
    """`last_kind` (the stage metrics' step kind): "prefill" for a step that fed a row of several positions (the
    prefix, a unit, a close), "decode" for one that fed decoded tokens only; both occur in a speaking session."""
    engine, _ = make_engine(sessions=1)
    engine.open("s1", Fence(1, 0), params=params(1))
    for k in range(4):
        engine.append("s1", Fence(1, 0, seq=k), unit_pcm(1, k))
    s, seen = engine.session("s1"), []
    while True:
        before = s.cached_len
        if not engine.step():
            break
        if engine.last_rows:
            seen.append((s.cached_len - before, engine.last_kind))
    assert {kind for _, kind in seen} == {"prefill", "decode"}
    assert all(kind == ("prefill" if fed > 1 else "decode") for fed, kind in seen), seen


def test_each_step_counts_its_decoded_token_rows_beside_a_prefill_too() -> None:
    """`last_token_rows` (P12's token steps): every row of a decode step, and in a step that also prefilled, the rows
    of one decoded token beside the prefill rows; two sessions a unit apart give both kinds of step."""
    engine, _ = make_engine(sessions=2)
    for sid, seed in (("a", 1), ("b", 2)):
        engine.open(sid, Fence(1, 0), params=params(seed))
    engine.append("a", Fence(1, 0, seq=0), unit_pcm(1, 0))
    seen = []

    def step() -> bool:
        busy = engine.step()
        if engine.last_rows:
            seen.append((engine.last_kind, engine.last_rows, engine.last_token_rows))
        return busy

    for k in range(6):  # b's unit arrives while a decodes its own
        engine.append("a", Fence(1, 0, seq=k + 1), unit_pcm(1, k + 1))
        while step() and seen[-1][0] != "decode":
            pass
        engine.append("b", Fence(1, 0, seq=k), unit_pcm(2, k))
        while step():
            pass
    assert all(tokens == rows for kind, rows, tokens in seen if kind == "decode"), seen
    assert any(kind == "prefill" and 0 < tokens < rows for kind, rows, tokens in seen), seen
