"""bench/loadgen/grid.py: the gateway's unit grid rebuilt from commits, and where a scripted-plan user speaks."""

from __future__ import annotations

import numpy as np

from bench.loadgen.grid import FIRST_UNIT, UNIT, UnitGrid, plan_speaks
from bench.loadgen.user import APPEND_SAMPLES, COMMIT_INTO_UNIT_S, VAD_SILENCE_S, User

PLAN = {"listen_units": 3, "speak_units": 2, "text_ids_per_unit": 3, "tail_listen_units": 0}


def test_regular_grid_then_a_commit_restarts_it() -> None:
    g = UnitGrid()
    assert g.unit_at(0) == (0, 0) and g.unit_at(FIRST_UNIT) == (1, FIRST_UNIT)
    assert g.end(0) == FIRST_UNIT and g.end(2) == FIRST_UNIT + 2 * UNIT
    g.flush_at(51_200)  # inside unit 3 [48480, 64480): it ends there, unit 4 starts at the commit
    assert g.end(3) == 51_200 and g.start(4) == 51_200 and g.end(5) == 51_200 + 2 * UNIT
    assert g.unit_at(51_200 + UNIT + 5) == (5, 51_200 + UNIT)
    g.flush_at(51_200 + UNIT)  # on a boundary: the residual is empty, no unit is padded
    assert g.start(5) == 51_200 + UNIT and len(g.anchors) == 3


def test_a_lost_grid_times_no_later_unit() -> None:
    g = UnitGrid()
    g.lose_at(40_000)
    assert g.end(1) == FIRST_UNIT + UNIT and g.end(2) is None


def test_plan_speaks_on_its_cycle_after_the_forced_units() -> None:
    assert [u for u in range(16) if plan_speaks(PLAN, u, 3)] == [3, 4, 8, 9, 13, 14]
    assert [u for u in range(16) if plan_speaks(PLAN, u, 4)] == [4, 8, 9, 13, 14]
    assert not any(plan_speaks(None, u, 0) for u in range(16))


def test_a_plan_user_starts_speaking_so_the_commit_lands_in_the_first_speak_unit() -> None:
    length = UNIT  # a 1 s sentence
    user = User(0, "ws://x:1", [np.zeros(length, np.int16)], 30.0, plan=PLAN)
    starts = [k for k in range(40) if user._plan_says_speak(k * APPEND_SAMPLES, length)]
    commit_at = [k * APPEND_SAMPLES + length + int(VAD_SILENCE_S * 16000) for k in starts]
    turn_starts = [user.log.grid.start(u) for u in (3, 8)]
    assert len(starts) == 2
    for commit, unit_start in zip(commit_at, turn_starts, strict=True):
        assert unit_start < commit <= unit_start + int(COMMIT_INTO_UNIT_S * 16000)


def test_a_plan_without_room_for_the_sentence_gets_no_user_turn() -> None:
    tight = {"listen_units": 1, "speak_units": 2, "text_ids_per_unit": 3, "tail_listen_units": 0}
    length = UNIT + APPEND_SAMPLES  # 1.2 s: more than the plan's one listen unit between turns
    user = User(0, "ws://x:1", [np.zeros(length, np.int16)], 30.0, plan=tight)
    starts = [k for k in range(60) if user._plan_says_speak(k * APPEND_SAMPLES, length)]
    # only the first turn (unit 4) has room: units 0-3 listen; later turns have 1 listen unit before them
    assert len(starts) == 1 and starts[0] * APPEND_SAMPLES < user.log.grid.start(3)


def test_with_the_gateways_unit_alignment_the_grid_restarts_on_the_tick_after_a_commit() -> None:
    """`--unit-align-s`: after a commit the gateway cuts the next unit on its next clock tick, where the chunk that
    passes the tick puts it (chunk k sent at t0 + 0.2 k, its audio taken as ending on arrival); the user's grid
    follows, so unit times and the plan's speech placement stay right."""
    user = User(0, "ws://x:1", [np.zeros(UNIT, np.int16)], 30.0, plan=PLAN, unit_align_s=1.0)
    user._t0 = 100.3  # the schedule: chunk k due at 100.3 + 0.2 k
    user.log.chunk_sent = [100.3 + 0.2 * k for k in range(40)]
    pos = 16 * APPEND_SAMPLES  # the commit's audio ended with chunk 15, sent at 103.3
    user._on_commit({"reason": "committed", "audio_end_ms": pos * 1000 // 16000}, 103.31)
    tick_cut = APPEND_SAMPLES + round((104.0 - 100.3) * 16000)  # the tick at 104.0
    assert user.log.grid.start(user.log.grid.unit_at(pos)[0]) == pos  # the commit's unit ended at the commit
    unit, start = user.log.grid.unit_at(tick_cut)
    assert start == tick_cut and user.log.grid.end(unit - 1) == tick_cut  # the short unit ended on the tick
    assert user.log.grid.end(unit) == tick_cut + UNIT
    plain = User(0, "ws://x:1", [np.zeros(UNIT, np.int16)], 30.0, plan=PLAN)
    plain._t0, plain.log.chunk_sent = user._t0, list(user.log.chunk_sent)
    plain._on_commit({"reason": "committed", "audio_end_ms": pos * 1000 // 16000}, 103.31)
    assert plain.log.grid.unit_at(tick_cut)[1] == pos  # no alignment: regular units from the commit on


def test_with_a_floor_of_live_sessions_the_grid_follows_the_gateways_count() -> None:
    """`unit_align_min_sessions`: the gateway aligns only while that many sessions are live; the user reads the
    load's own open sessions at each commit, so its grid restarts on the tick only at or above the floor."""
    pos = 16 * APPEND_SAMPLES
    tick_cut = APPEND_SAMPLES + round((104.0 - 100.3) * 16000)
    live = [3]
    user = User(0, "ws://x:1", [np.zeros(UNIT, np.int16)], 30.0, plan=PLAN, unit_align_s=1.0,
                unit_align_min_sessions=4, live_sessions=lambda: live[0])
    user._t0, user.log.chunk_sent = 100.3, [100.3 + 0.2 * k for k in range(40)]
    user._on_commit({"reason": "committed", "audio_end_ms": pos * 1000 // 16000}, 103.31)
    assert user.log.grid.unit_at(tick_cut)[1] == pos  # 3 live: no tick, regular units from the commit on
    live[0] = 4
    at_floor = User(0, "ws://x:1", [np.zeros(UNIT, np.int16)], 30.0, plan=PLAN, unit_align_s=1.0,
                    unit_align_min_sessions=4, live_sessions=lambda: live[0])
    at_floor._t0, at_floor.log.chunk_sent = user._t0, list(user.log.chunk_sent)
    at_floor._on_commit({"reason": "committed", "audio_end_ms": pos * 1000 // 16000}, 103.31)
    assert at_floor.log.grid.unit_at(tick_cut)[1] == tick_cut  # the short unit ended on the tick
