"""Stage1 `first_codes`: a turn-start unit's first K codes leave during the step, and head + rest is the unit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.tts import TTSModel
from engine.stage1.config import TTSEngineConfig
from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import TTSHeadCodes, TTSUnitRequest, TTSUnitResult
from tests.engine.test_tts_engine import F0, _cfg, _unit
from tests.engine.test_tts_helpers import tiny_model, with_eos_bias

K = 3


class Recorder:
    """Heads and results in the order the engine hands them out."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def on_head(self, heads: list[TTSHeadCodes]) -> None:
        self.log.extend(("head", h) for h in heads)

    def run(self, engine: TTSEngine) -> list[TTSUnitResult]:
        out: list[TTSUnitResult] = []
        while engine.pending():
            results = engine.step(on_head=self.on_head)
            self.log.extend(("result", r) for r in results)
            out.extend(results)
        return out

    def heads(self) -> dict[tuple[str, int], TTSHeadCodes]:
        return {(h.session_id, h.unit_index): h for kind, h in self.log if kind == "head"}  # type: ignore[union-attr]


def _turn(model: TTSModel, first_codes: int, units: list[TTSUnitRequest], seeds: dict[str, int],
          rec: Recorder | None = None) -> list[TTSUnitResult]:
    engine = TTSEngine(model, _cfg(first_codes=first_codes, max_sessions=16))
    for sid, seed in seeds.items():
        engine.open(sid, F0, seed=seed)
    rec = rec or Recorder()
    out: list[TTSUnitResult] = []
    for req in units:  # one unit per step, in this order
        engine.submit(req)
        out += rec.run(engine)
    return out


def _unsent(results: list[TTSUnitResult]) -> list[TTSUnitResult]:
    return [dataclasses.replace(r, head=0) for r in results]


def test_turn_start_unit_sends_its_first_codes_during_the_step() -> None:
    model, rec = tiny_model(), Recorder()
    units = [_unit("a", 0, 3, start=True), _unit("a", 1, 4), _unit("a", 2, 2, end=True)]
    got = _turn(model, K, units, {"a": 7}, rec)
    want = _turn(model, 0, units, {"a": 7})
    assert _unsent(got) == want  # the same codes, draws and positions as without heads
    first = got[0]
    assert [kind for kind, _ in rec.log] == ["head", "result", "result", "result"]  # the head before its step ends
    head = rec.log[0][1]
    assert head == TTSHeadCodes("a", F0, 0, want[0].codes[:K], 25)
    assert first.head == K and first.codes == want[0].codes  # codes stay the whole unit: head + rest
    assert head.codes + first.codes[first.head:] == want[0].codes
    assert [r.head for r in got[1:]] == [0, 0]  # later units of the turn start mid-turn


def test_second_unit_of_a_turn_gets_no_head() -> None:
    model, rec = tiny_model(), Recorder()
    got = _turn(model, K, [_unit("a", 0, 2, start=True), _unit("a", 1, 3)], {"a": 2}, rec)
    assert got[1].start_pos > 0 and got[1].head == 0
    assert set(rec.heads()) == {("a", 0)}


def test_head_every_unit_sends_every_units_first_codes() -> None:
    """`head_every_unit`: mid-turn units send their first K codes early too, with the codes of units sent whole."""
    model, rec = tiny_model(), Recorder()
    units = [_unit("a", 0, 2, start=True), _unit("a", 1, 3), _unit("a", 2, 4)]
    engine = TTSEngine(model, _cfg(first_codes=K, head_every_unit=True))
    engine.open("a", F0, seed=3)
    got: list[TTSUnitResult] = []
    for req in units:
        engine.submit(req)
        got += rec.run(engine)
    want = _turn(model, 0, units, {"a": 3})
    assert _unsent(got) == want and [r.head for r in got] == [K, K, K]
    assert got[1].start_pos > 0 and got[2].start_pos > 0  # mid-turn units
    heads = rec.heads()
    assert [heads[("a", u)].codes for u in range(3)] == [w.codes[:K] for w in want]
    assert [kind for kind, _ in rec.log] == ["head", "result"] * 3  # each head before its unit's result


def test_a_new_turn_sends_a_head_again() -> None:
    model, rec = tiny_model(), Recorder()
    units = [_unit("a", 0, 2, start=True), _unit("a", 1, 3, end=True), _unit("a", 2, 2, start=True)]
    got = _turn(model, K, units, {"a": 4}, rec)
    assert got[2].start_pos == 0 and [r.head for r in got] == [K, 0, K]
    assert set(rec.heads()) == {("a", 0), ("a", 2)}


def test_head_with_eos_is_not_sent() -> None:
    """EOS is allowed at turn start: rows that draw it within the first K codes go out whole at the end."""
    model = with_eos_bias(tiny_model(), 6.0)  # EOS early but at different steps per seed
    seeds = {f"s{i}": i for i in range(12)}
    units = [_unit(sid, 0, 3, start=True, seed=seed) for sid, seed in seeds.items()]
    want = {r.session_id: r for r in _turn(model, 0, units, seeds)}

    engine, rec = TTSEngine(model, _cfg(max_sessions=12, max_batch=12, first_codes=K)), Recorder()
    for sid, seed in seeds.items():
        engine.open(sid, F0, seed=seed)
    for req in units:
        engine.submit(req)
    got = {r.session_id: r for r in rec.run(engine)}  # one batched step: all rows at turn start
    heads = rec.heads()
    early = {sid for sid, r in want.items() if r.eos and len(r.codes) < K}
    assert early and len(early) < len(seeds)  # both kinds of rows in the batch
    assert {sid for sid, _ in heads} == set(seeds) - early
    for sid, r in got.items():
        assert dataclasses.replace(r, head=0) == want[sid]
        assert r.head == (0 if sid in early else K)
        if sid not in early:
            assert heads[(sid, 0)].codes == r.codes[:K]
    assert any(r.eos and len(r.codes) >= K for r in got.values())  # EOS after the head: a short rest


def test_batch_of_turn_start_and_mid_turn_rows() -> None:
    model = tiny_model()
    warm = _unit("b", 0, 4, start=True, seed=1)
    batch = [_unit("a", 0, 3, start=True), _unit("b", 1, 2, seed=1)]
    engine, rec = TTSEngine(model, _cfg(first_codes=K)), Recorder()
    for sid, seed in (("a", 5), ("b", 6)):
        engine.open(sid, F0, seed=seed)
    engine.submit(warm)
    rec.run(engine)
    rec.log.clear()
    for req in batch:
        engine.submit(req)
    a, b = sorted(engine.step(on_head=rec.on_head), key=lambda r: r.session_id)  # both rows in one step
    assert engine.pending() == 0
    assert a.start_pos == 0 and b.start_pos > 0
    assert set(rec.heads()) == {("a", 0)} and (a.head, b.head) == (K, 0)
    assert rec.heads()[("a", 0)].codes == a.codes[:K]
    solo_a = _turn(model, 0, [batch[0]], {"a": 5})
    solo_b = _turn(model, 0, [warm, batch[1]], {"b": 6})
    assert [dataclasses.replace(a, head=0), b] == [solo_a[0], solo_b[1]]


def test_runner_head_is_a_read_back_only() -> None:
    engine = TTSEngine(tiny_model(), _cfg())
    runner, g = engine.runner, torch.Generator().manual_seed(0)
    cond = torch.randn(2, 5, 64, generator=g)  # [B, T, H]
    args = (cond, [4, 2], [0, 30], [0, 1], [True, False], torch.rand(2, 26, dtype=torch.float64, generator=g))
    whole = runner.run_unit(*args)
    seen: list[torch.Tensor] = []
    with_head = runner.run_unit(*args, head=K, on_head=seen.append)
    assert torch.equal(with_head, whole)
    (head,) = seen
    assert head.dtype == torch.int64 and head.device.type == "cpu" and torch.equal(head, whole[:, :K])
    runner.run_unit(*args, on_head=seen.append)  # head 0: no callback
    assert len(seen) == 1
    with pytest.raises(ValueError, match="head"):
        runner.run_unit(*args, head=26, on_head=seen.append)


def test_first_codes_is_validated() -> None:
    assert TTSEngineConfig(first_codes=24).first_codes == 24  # max_new_tokens 26: the rest keeps >= 1 code
    for bad in (-1, 25):
        with pytest.raises(ValueError, match="first_codes"):
            TTSEngineConfig(first_codes=bad)
    with pytest.raises(ValueError, match="head_every_unit"):  # every unit's head needs a head size
        TTSEngineConfig(head_every_unit=True)
    engine = TTSEngine(tiny_model(), _cfg())  # 0: off, even with a callback
    engine.open("a", F0, seed=1)
    engine.submit(_unit("a", 0, 2, start=True))
    rec = Recorder()
    (res,) = rec.run(engine)
    assert res.head == 0 and [kind for kind, _ in rec.log] == ["result"]
