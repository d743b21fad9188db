"""Figures of one sweep step (N sessions) from the users' raw receipt stamps (protocol.md §10.2 definitions).

- `commit_to_first_audio_ms`: receipt of a server-VAD `input_audio_buffer.committed` (the gateway decides the
  commit, so its receipt is the client's first sight of it) -> first audio delta of the first response created
  after it; absent when no response with audio followed before the next commit.
- `response_created_to_first_audio_ms`: per response.
- `unit_to_first_audio_ms` (P6 at the client): send of the last input chunk of the unit whose speak decision
  opened a response -> that response's first audio delta; `unit_to_decision_ms`: the same origin -> the
  unit's `response.listen` / `response.speak`. Units come from the rebuilt grid (grid.py); none are timed
  past a point where the grid is unknown.
- `unit_to_audio_by_position_ms`: the same origin -> each unit's first audio, by the unit's position in its
  response; `unit_to_audio_step_ms`: per pair of consecutive units of a response, how much later the second's
  audio came after its send than the first's (units are sent 1 s apart, so their first audio is 1 s + this
  apart); `over_200`: pairs whose first audio came more than 1.2 s apart. `unit_step_sources_ms`: those steps
  cut by the stage whose time grew (the gateway's per-unit stage times), over all and over the top tenth.
- `cancel_to_last_audio_ms`: send time of our `response.cancel` -> receipt of the cancelled response's last
  audio delta (0 if none arrived after the cancel); `cancel_to_done_ms`: the same origin -> its `response.done`.
- `transcript_delay_ms`: per model unit, first transcript delta receipt - first audio delta receipt (negative
  = the text arrived ahead of the audio).
- `transcript_behind_generation_ms` (targets.md P13, added by load_realtime.py from the gateway's /metrics, see
  text_wait.py): per delta, token sampled by stage0 -> its transcript/text delta handed to the client's socket;
  unlike `transcript_delay_ms` it includes the time the text waited for its unit's audio (C-3 pairing).
- `gateway` (added by load_realtime.py from the gateway's /metrics, see gateway_load.py): the gateway process's CPU
  seconds per second of the level (`cpu_share`) and its event loop's lag behind a 100 ms timer (`loop_lag_ms`).
- chunk gaps: receive-time intervals between consecutive audio deltas of a response; player: the §10.2
  gapless 1x player, an underrun is a gap > `UNDERRUN_EPS_MS`.
- real-time factor of a response: its audio duration / (last delta end - first delta receipt) on a 1x player.

A session holds real time (targets.md P8) when it stayed up, received audio, no chunk gap exceeded 1.2 s and
its returned audio kept pace (real-time factor >= `MIN_RTF`). A run holds when every session did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.loadgen.user import APPEND_SAMPLES, ResponseLog, UserLog

MAX_CHUNK_GAP_MS = 1200.0  # targets.md P8
MIN_RTF = 0.9  # audio keeps pace: at most 10 % of the playing time spent waiting for the next chunk (a
# 100 ms late chunk in a 3-unit turn costs 3 %: jitter passes, a server that falls behind does not)
UNDERRUN_EPS_MS = 10.0  # a player gap shorter than this is scheduling noise, not an audible underrun
MS = 1000.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (protocol.md §10.1 SM-4), q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pcts(values: Sequence[float], *qs: int) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {f"p{q}": (round(percentile(values, q), 1) if values else None) for q in qs}
    out["count"] = len(values)
    return out


@dataclass
class Player:
    underruns: int = 0
    underrun_ms: float = 0.0
    max_gap_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)  # every receipt interval (how close to the bound)
    audio_ms: float = 0.0
    span_ms: float = 0.0  # first receipt -> end of the last chunk on the player


def play(resp: ResponseLog) -> Player:
    p, end = Player(), None
    for i, (t, dur) in enumerate(zip(resp.audio_t, resp.audio_ms, strict=True)):
        t_ms = t * MS
        if i:
            p.gaps_ms.append((t - resp.audio_t[i - 1]) * MS)
            p.max_gap_ms = max(p.max_gap_ms, p.gaps_ms[-1])
        if end is not None and t_ms - end > UNDERRUN_EPS_MS:
            p.underruns += 1
            p.underrun_ms += t_ms - end
        end = t_ms + dur if end is None else max(t_ms, end) + dur
        p.audio_ms += dur
    if resp.audio_t:
        p.span_ms = end - resp.audio_t[0] * MS
    return p


def commit_latencies(log: UserLog) -> list[float]:
    out = []
    commits = sorted(log.commits)
    responses = sorted(log.responses.values(), key=lambda r: r.created_t)
    for i, c in enumerate(commits):
        until = commits[i + 1] if i + 1 < len(commits) else float("inf")
        nxt = next((r for r in responses if c < r.created_t < until), None)
        if nxt is not None and nxt.audio_t:
            out.append((nxt.audio_t[0] - c) * MS)
    return out


def unit_sent(log: UserLog, unit: int) -> float | None:
    """Send time of the append holding the unit's last input sample (None where the grid is unknown)."""
    end = log.grid.end(unit)
    k = None if end is None else (end - 1) // APPEND_SAMPLES
    return log.chunk_sent[k] if k is not None and k < len(log.chunk_sent) else None


def unit_latencies(log: UserLog) -> tuple[list[float], list[float]]:
    """(unit -> first audio of the response it opened, unit -> its decision) in ms."""
    audio = [(r.audio_t[0] - sent) * MS for r in log.responses.values()
             if r.audio_t and r.speak_unit is not None and (sent := unit_sent(log, r.speak_unit)) is not None]
    decided = [(t - sent) * MS for unit, t in log.decisions if (sent := unit_sent(log, unit)) is not None]
    return audio, decided


UNIT_STEP_BOUND_MS = MAX_CHUNK_GAP_MS - 1000.0  # a step over this: two units' first audio over 1.2 s apart
POSITIONS = ("1", "2", "3", "4+")  # unit latency by position in the response: 1st, 2nd, 3rd, 4th and later


def position(i: int) -> str:
    """The `POSITIONS` key of a response's i-th unit (0-based)."""
    return POSITIONS[min(i, len(POSITIONS) - 1)]


def response_unit_audio(log: UserLog, r: ResponseLog) -> list[tuple[int, float]]:
    """(position in the response, unit sent -> that unit's first audio in ms) for the response's units in order,
    those whose send time is known."""
    return [(i, (r.unit_audio_t[unit] - sent) * MS) for i, unit in enumerate(sorted(r.unit_audio_t))
            if (sent := unit_sent(log, unit)) is not None]


def unit_audio_by_position(log: UserLog) -> dict[str, list[float]]:
    """Unit sent -> that unit's first audio (ms), keyed by the unit's position in its response (`POSITIONS`): a
    latency that grows along a response makes the chunk gaps exceed 1 s."""
    out: dict[str, list[float]] = {k: [] for k in POSITIONS}
    for r in log.responses.values():
        for i, ms in response_unit_audio(log, r):
            out[position(i)].append(ms)
    return out


def response_unit_steps(log: UserLog, r: ResponseLog) -> list[tuple[int, float]]:
    """(position i, how much later (ms) unit i + 1's audio came after its send than unit i's did) for each pair of
    consecutive units of the response whose send times are known."""
    lat = response_unit_audio(log, r)
    return [(i, b - a) for (i, a), (j, b) in zip(lat, lat[1:], strict=False) if j == i + 1]


def unit_audio_steps(log: UserLog) -> list[float]:
    """How much later (ms) each unit's audio came after its send than the previous unit's of the same response
    did: their first audio is 1 s + this apart, so the steps say whether the latency grows from unit to unit
    (the P8 question: do the chunk gaps over 1.2 s come from such growth, or from within a unit's audio?)."""
    return [step for r in log.responses.values() for _, step in response_unit_steps(log, r)]


def cancel_latency(resp: ResponseLog) -> float | None:
    if resp.cancel_t is None:
        return None
    after = [t for t in resp.audio_t if t >= resp.cancel_t]
    return (after[-1] - resp.cancel_t) * MS if after else 0.0


def cancel_to_done(resp: ResponseLog) -> float | None:
    if resp.cancel_t is None or resp.done_t is None or resp.done_t < resp.cancel_t:
        return None
    return (resp.done_t - resp.cancel_t) * MS


def session_figures(log: UserLog) -> dict[str, Any]:
    players = [play(r) for r in log.responses.values()]
    audio_ms = sum(p.audio_ms for p in players)
    span_ms = sum(p.span_ms for p in players)
    rtf = audio_ms / span_ms if span_ms > 0 else None
    max_gap = max((p.max_gap_ms for p in players), default=0.0)
    reason = None
    if log.failure is not None:
        reason = log.failure
    elif audio_ms == 0:
        reason = "no audio received"
    elif max_gap > MAX_CHUNK_GAP_MS:
        reason = f"chunk gap {max_gap:.0f} ms > {MAX_CHUNK_GAP_MS:.0f} ms"
    elif rtf is not None and rtf < MIN_RTF:
        reason = f"real-time factor {rtf:.3f} < {MIN_RTF}"
    return {"index": log.index, "session_id": log.session_id, "held_realtime": reason is None, "not_held": reason,
            "responses": len(log.responses), "audio_s": round(audio_ms / MS, 3),
            "realtime_factor": None if rtf is None else round(rtf, 4), "max_chunk_gap_ms": round(max_gap, 1),
            "underruns": sum(p.underruns for p in players),
            "underrun_ms": round(sum(p.underrun_ms for p in players), 1),
            "commits": len(log.commits), "cancels_sent": log.cancels_sent, "cancel_races": log.cancel_races,
            "max_send_lag_ms": round(log.max_send_lag_ms, 1), "errors": dict(log.errors)}


PHASE_WINDOW_S = 0.1  # "in phase": two sessions' responses start their audio within this of each other


def timeline(log: UserLog, t0: float) -> dict[str, Any]:
    """When (s after the level's first session opened) the session opened, committed, and got each response's
    first audio: what the cold-vs-warm question of bench/h200/README.md needs (are the sessions in phase?)."""
    rel = lambda t: round(t - t0, 3)  # noqa: E731 - a local formatter
    firsts = sorted(r.audio_t[0] for r in log.responses.values() if r.audio_t)
    return {"opened_s": None if log.opened_t is None else rel(log.opened_t),
            "commits_s": [rel(t) for t in log.commits], "first_audio_s": [rel(t) for t in firsts]}


def in_phase(logs: list[UserLog]) -> float | None:
    """Mean number of OTHER sessions whose response's first audio came within `PHASE_WINDOW_S` of a response's
    first audio: about (N - 1) × the window's share of the response period when phases are independent."""
    firsts = [(i, r.audio_t[0]) for i, log in enumerate(logs) for r in log.responses.values() if r.audio_t]
    if not firsts:
        return None
    near = [len({j for j, u in firsts if j != i and abs(u - t) <= PHASE_WINDOW_S}) for i, t in firsts]
    return round(sum(near) / len(near), 3)


# (figure, stage key, field): *_first_output from the unit's send to stage0 (as before stop 39), *_own from the
# stage's own input (the TTS's tts_input, the Token2Wav's first codes) to its first output
FIRST_UNIT_STAGES = (("thinker_ttft", "0", "ttft_ms"), ("talker_first_output", "1", "from_unit_ms"),
                     ("code2wav_first_output", "2", "from_unit_ms"), ("talker_own", "1", "first_output_ms"),
                     ("code2wav_own", "2", "first_output_ms"))


def first_unit_stages(responses: list[ResponseLog]) -> dict[str, Any]:
    """Where commit→first audio goes, from each response's `stage_metrics` (protocol.md §10.1): stage0's first token
    of the response's first unit after the engine took the unit, and the first TTS codes / first audio at the
    gateway after it sent that unit to stage0; and each of the two from its own input (so the time from stage0's first
    token to the TTS's input is talker_first_output - talker_own - thinker_ttft, about). The rest of commit→first
    audio is the gateway before the send (the unit's cut) and the socket."""
    out: dict[str, Any] = {"measures": "p50/p99 over responses of response.done duplex.stage_metrics: stage0 ttft "
                                       "(engine: unit taken -> first token), TTS and Token2Wav first output (gateway: "
                                       "unit sent to stage0 -> first codes / first audio back; *_own: from the stage's "
                                       "own input sent -> its first output)"}
    for name, key, field_ in FIRST_UNIT_STAGES:
        values = [float(v) for r in responses if r.stage_metrics
                  and (v := (r.stage_metrics.get(key) or {}).get(field_)) is not None]
        out[name] = pcts(values, 50, 99)
    return out


# (figure, stage key) of each owned unit's time from its send to stage 0 (response.done stage_metrics'
# `from_unit_ms_by_unit`, gateway clock): stage0's unit_done, the TTS's first codes, the Token2Wav's first audio
UNIT_STAGES = (("thinker_done", "0"), ("talker_first", "1"), ("code2wav_first", "2"))


def unit_stage_times(r: ResponseLog, key: str) -> list[float | None]:
    """Stage `key`'s `from_unit_ms_by_unit` in the response's `response.done` (empty when it gave none)."""
    return ((r.stage_metrics or {}).get(key) or {}).get("from_unit_ms_by_unit") or []


def unit_stages_by_position(responses: list[ResponseLog]) -> dict[str, Any]:
    """Each stage's place in a unit's latency by the unit's position in its response (`POSITIONS`): which stage
    the growth along a response (`unit_to_audio_by_position_ms`, the P8 gaps) comes from."""
    out: dict[str, Any] = {"measures": "p50/p99 over owned units of response.done duplex.stage_metrics "
                                       "from_unit_ms_by_unit (gateway: unit sent to stage0 -> stage0 unit_done / "
                                       "first TTS codes / first audio), by position in the response"}
    for name, key in UNIT_STAGES:
        by_pos: dict[str, list[float]] = {k: [] for k in POSITIONS}
        for r in responses:
            for i, ms in enumerate(unit_stage_times(r, key)):
                if ms is not None:
                    by_pos[position(i)].append(float(ms))
        out[name] = {k: pcts(v, 50, 99) for k, v in by_pos.items()}
    return out


STEP_PARTS = ("stage0", "tts", "token2wav", "rest")
BIG_STEP_Q = 90  # "big" unit steps: the top tenth, where the P8 gaps come from


def unit_step_parts(log: UserLog) -> list[dict[str, float]]:
    """Each step of `unit_audio_steps` cut by where it grew, from the response's `from_unit_ms_by_unit` (gateway
    clock, from each unit's send to stage0): `stage0` the change in unit_done, `tts` in unit_done -> first codes,
    `token2wav` in first codes -> first audio, `rest` the remainder (the gateway's send against the client's, and
    the delivery). Only pairs where every stage timed both units, in responses whose lists match their audio units."""
    out = []
    for r in log.responses.values():
        times = [unit_stage_times(r, key) for _, key in UNIT_STAGES]
        if any(len(t) != len(r.unit_audio_t) for t in times):
            continue
        for i, step in response_unit_steps(log, r):
            a, b = [t[i] for t in times], [t[i + 1] for t in times]
            if None in a or None in b:
                continue
            s0, tts, t2w = b[0] - a[0], (b[1] - b[0]) - (a[1] - a[0]), (b[2] - b[1]) - (a[2] - a[1])
            out.append({"step": step, "stage0": s0, "tts": tts, "token2wav": t2w, "rest": step - (b[2] - a[2])})
    return out


def unit_step_sources(parts: list[dict[str, float]]) -> dict[str, Any]:
    """Mean of each part over every timed step and over the big ones (at or above the steps' p90)."""
    def mean(rows: list[dict[str, float]]) -> dict[str, Any]:
        return {"count": len(rows)} | {k: round(sum(r[k] for r in rows) / len(rows), 1) if rows else None
                                       for k in ("step", *STEP_PARTS)}
    cut = percentile([p["step"] for p in parts], BIG_STEP_Q) if parts else 0.0
    return {"measures": "mean ms a unit's first audio moved from the previous unit's of its response (step), cut by "
                        "stage: stage0 unit_done, unit_done -> first TTS codes, first codes -> first audio (gateway, "
                        "from_unit_ms_by_unit), rest; over all timed steps and the top tenth (big)",
            "all": mean(parts), "big": mean([p for p in parts if p["step"] >= cut])}


def run_figures(sessions: int, logs: list[UserLog], scripted: bool | None) -> dict[str, Any]:
    per = [session_figures(log) for log in logs]
    starts = [t for log in logs for t in ([log.opened_t] if log.opened_t is not None else log.commits[:1])]
    t0 = min(starts, default=0.0)
    for p, log in zip(per, logs, strict=True):
        p["timeline"] = timeline(log, t0)
    responses = [r for log in logs for r in log.responses.values()]
    gaps = [g for r in responses for g in play(r).gaps_ms]
    commit_ms = [x for log in logs for x in commit_latencies(log)]
    created_ms = [(r.audio_t[0] - r.created_t) * MS for r in responses if r.audio_t]
    by_unit = [unit_latencies(log) for log in logs]
    by_position = [unit_audio_by_position(log) for log in logs]
    steps = [x for log in logs for x in unit_audio_steps(log)]
    cancel_ms = [x for r in responses if (x := cancel_latency(r)) is not None]
    text_ms = [(r.unit_text_t[u] - t) * MS for r in responses for u, t in r.unit_audio_t.items() if u in r.unit_text_t]
    rtfs = [p["realtime_factor"] for p in per if p["realtime_factor"] is not None]
    errors: Counter[str] = Counter()
    for log in logs:
        errors.update(log.errors)
    return {
        "sessions": sessions, "scripted": scripted, "held_realtime": bool(per) and all(p["held_realtime"] for p in per),
        "not_held": sorted({p["not_held"] for p in per if p["not_held"]})[:5],
        "commit_to_first_audio_ms": pcts(commit_ms, 50, 99),
        "response_created_to_first_audio_ms": pcts(created_ms, 50, 99),
        "unit_to_first_audio_ms": pcts([x for audio, _ in by_unit for x in audio], 50, 99),
        "unit_to_decision_ms": pcts([x for _, decided in by_unit for x in decided], 50, 99),
        "unit_to_audio_by_position_ms": {k: pcts([x for pos in by_position for x in pos[k]], 50, 99)
                                         for k in POSITIONS},
        "unit_to_audio_step_ms": pcts(steps, 50, 90, 99) | {"over_200": sum(x > UNIT_STEP_BOUND_MS for x in steps)},
        "cancel_to_last_audio_ms": pcts(cancel_ms, 50, 99),
        "cancel_to_done_ms": pcts([x for r in responses if (x := cancel_to_done(r)) is not None], 50, 99),
        "transcript_delay_ms": pcts(text_ms, 50, 99),
        "first_unit_stages_ms": first_unit_stages(responses),
        "unit_stages_by_position_ms": unit_stages_by_position(responses),
        "unit_step_sources_ms": unit_step_sources([x for log in logs for x in unit_step_parts(log)]),
        "max_chunk_gap_ms": round(max((p["max_chunk_gap_ms"] for p in per), default=0.0), 1),
        "chunk_gap_ms": pcts(gaps, 50, 90, 99) | {"over_bound": sum(g > MAX_CHUNK_GAP_MS for g in gaps)},
        "underruns": sum(p["underruns"] for p in per),
        "underrun_ms": round(sum(p["underrun_ms"] for p in per), 1),
        "realtime_factor": {"min": min(rtfs, default=None),
                            "p50": round(percentile(rtfs, 50), 4) if rtfs else None},
        "responses": len(responses), "audio_s": round(sum(p["audio_s"] for p in per), 3),
        "first_audio_in_phase": in_phase(logs),
        "cancels_sent": sum(log.cancels_sent for log in logs),
        "max_send_lag_ms": round(max((log.max_send_lag_ms for log in logs), default=0.0), 1),
        "errors": dict(errors),
        "per_session": per,
    }
