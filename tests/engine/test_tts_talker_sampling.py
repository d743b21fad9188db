"""Each session's talker temperature and repetition penalty take effect, per row of the batch (issue 17)."""

from __future__ import annotations

import pytest

from engine.stage1.tts_engine import TTSEngine
from engine.stage1.types import BadSamplingError
from tests.engine.test_tts_engine import F0, _cfg, _run, _unit
from tests.engine.test_tts_helpers import tiny_model

UNITS = [(4, False), (3, False), (5, True)]  # (rows, end_of_turn)


def codes(runs: dict[str, dict]) -> dict[str, list[tuple[int, ...]]]:
    """Open every session (name -> open kwargs), run the same units for all at once; each session's codes."""
    engine = TTSEngine(tiny_model(), _cfg())
    for sid, kw in runs.items():
        engine.open(sid, F0, seed=3, **kw)
    for i, (n, end) in enumerate(UNITS):
        for sid in runs:
            engine.submit(_unit(sid, i, n, end=end, start=i == 0, seed=1))
    out: dict[str, list[tuple[int, ...]]] = {sid: [] for sid in runs}
    for res in sorted(_run(engine), key=lambda r: r.unit_index):
        out[res.session_id].append(tuple(res.codes))
    return out


def test_talker_settings_change_the_codes_and_stay_in_their_row() -> None:
    together = codes({"base": {}, "cold": {"temperature": 0.2}, "rep": {"repetition_penalty": 3.0}})
    alone = {sid: codes({sid: kw})[sid] for sid, kw in
             (("base", {}), ("cold", {"temperature": 0.2}), ("rep", {"repetition_penalty": 3.0}))}
    assert together == alone  # a batch of mixed settings: every row samples as if alone
    assert together["cold"] != together["base"] and together["rep"] != together["base"]
    assert codes({"cfg": {"temperature": 0.8, "repetition_penalty": 1.05}})["cfg"] == together["base"]  # defaults


def test_update_applies_to_the_next_units_and_bad_values_are_refused() -> None:
    engine = TTSEngine(tiny_model(), _cfg())
    engine.open("s", F0, seed=3)
    engine.set_sampling("s", temperature=0.2)
    assert (engine.sessions["s"].temperature, engine.sessions["s"].repetition_penalty) == (0.2, 1.05)
    for bad in ({"temperature": 0.0}, {"repetition_penalty": float("nan")}, {"temperature": -1.0}):
        with pytest.raises(BadSamplingError):
            engine.set_sampling("s", **bad)
        with pytest.raises(BadSamplingError):
            engine.open("t", F0, seed=1, **bad)
    assert "t" not in engine.sessions and engine.sessions["s"].temperature == 0.2  # nothing changed
