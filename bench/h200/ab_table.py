"""The served A/B's figures side by side, as bench/RESULTS.md tables them: one markdown row per variant and load level.

    python bench/h200/ab_table.py a=OUT/a.json p0=OUT/p0.json [...]   # or plain paths (the file name is the variant)

Reads the load JSONs of bench/load_realtime.py (what bench/h200/ab_run.sh brings back) and prints, per variant and
session count: held, commit->first audio p50 / p99, each stage's step, queue wait, rows per step and busy time,
stage0's prefill and decode steps apart (`stage_step_ms_by_kind`), P12 (`p12`: token rows per step that decoded tokens,
the sessions speaking, their share), the first
unit's TTS and Token2Wav times, and cancel->last audio; then a second table of P8's chunk gaps and the player's
underruns, a unit's latency by its position in the response and each stage's place in it, and the gateway's load. A figure a JSON lacks
(older files, a level with no cancel) reads "-". The commit and the profile of each file come first, so a table
never mixes runs unawares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.loadgen.stages import STAGES  # noqa: E402  - the load generator's order of the stage columns

COLUMNS = ("variant", "N", "held", "commit->first audio p50 / p99", "step ms s0 / tts / t2w",
           "s0 prefill / decode step ms", "s0 prefill / decode steps", "s0 rows per decode step",
           "P12 token rows / speaking", "queue ms s0 / tts / t2w", "rows/step s0 / tts / t2w",
           "busy ms per s s0 / tts / t2w", "talker_own / code2wav_own p50",
           "cancel->last audio p50 / p99")


def _num(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pair(d: dict[str, Any] | None, digits: int = 0) -> str:
    d = d or {}
    return f"{_num(d.get('p50'), digits)} / {_num(d.get('p99'), digits)}"


def _stages(d: dict[str, Any] | None, digits: int = 1) -> str:
    d = d or {}
    return " / ".join(_num(d.get(s), digits) for s in STAGES)


def _held(run: dict[str, Any]) -> str:
    if run.get("held_realtime"):
        return "yes"
    gaps = run.get("chunk_gap_ms") or {}
    return f"NO ({gaps.get('over_bound', '-')} gaps over 1.2 s, max {_num(run.get('max_chunk_gap_ms'), 0)})"


def _p12(p: dict[str, Any]) -> str:
    if p.get("share") is None:
        return "-"
    return f"{_num(p['token_rows_per_step'], 2)} / {_num(p['speaking_sessions'], 2)} = {_num(p['share'], 2)}"


def row(name: str, run: dict[str, Any]) -> list[str]:
    kinds = (run.get("stage_step_ms_by_kind") or {}).get("stage0") or {}
    prefill, decode = kinds.get("prefill") or {}, kinds.get("decode") or {}
    firsts = run.get("first_unit_stages_ms") or {}
    own = [(firsts.get(k) or {}).get("p50") for k in ("talker_own", "code2wav_own")]
    return [name, str(run.get("sessions", "-")), _held(run), _pair(run.get("commit_to_first_audio_ms")),
            _stages(run.get("stage_step_ms")),
            f"{_num(prefill.get('mean_ms'))} / {_num(decode.get('mean_ms'))}",
            f"{_num(prefill.get('steps'), 0)} / {_num(decode.get('steps'), 0)}",  # fewer prefill steps: units gathered
            _num(decode.get("mean_rows"), 2),
            _p12(run.get("p12") or {}),
            _stages(run.get("stage_queue_wait_ms")), _stages(run.get("stage_rows_per_step"), 2),
            _stages(run.get("stage_busy_ms_per_s"), 0), " / ".join(_num(x, 0) for x in own),
            _pair(run.get("cancel_to_last_audio_ms"))]


# the second table: P8's chunk gaps and the player's underruns, then a unit's latency by its position in the response
# (the gaps come from its growth), the client's figure and, from the gateway, each stage's place in it (stage0 done,
# first TTS codes, first audio)
POSITION_COLUMNS = ("variant", "N", "chunk gap p90 / p99 / max", "underruns (s)", "unit->audio p50 by position 1 / 2 / 3",
                    "unit step p50 / p90 / p99 (over 200)", "s0 done p50 by position", "first TTS codes p50 by position",
                    "first audio (gateway) p50 by position", "top-tenth unit step ms: s0 / tts / t2w / rest",
                    "gateway CPU share, loop lag p50 / p99 ms")
_POSITIONS = ("1", "2", "3")


def _by_position(d: dict[str, Any] | None) -> str:
    d = d or {}
    return " / ".join(_num((d.get(k) or {}).get("p50"), 0) for k in _POSITIONS)


def position_row(name: str, run: dict[str, Any]) -> list[str]:
    step = run.get("unit_to_audio_step_ms") or {}
    stages = run.get("unit_stages_by_position_ms") or {}
    gaps, underrun_ms = run.get("chunk_gap_ms") or {}, run.get("underrun_ms")
    return [name, str(run.get("sessions", "-")),
            " / ".join(_num(x, 0) for x in (gaps.get("p90"), gaps.get("p99"), run.get("max_chunk_gap_ms"))),
            f"{run.get('underruns', '-')} ({_num(None if underrun_ms is None else underrun_ms / 1000)})",
            _by_position(run.get("unit_to_audio_by_position_ms")),
            " / ".join(_num(step.get(k), 0) for k in ("p50", "p90", "p99")) + f" ({step.get('over_200', '-')})",
            *(_by_position(stages.get(k)) for k in ("thinker_done", "talker_first", "code2wav_first")), _big_steps(run),
            _gateway(run)]


def _gateway(run: dict[str, Any]) -> str:
    """How loaded the one gateway process was (bench/loadgen/gateway_load.py): its CPU share and loop lag."""
    gw = run.get("gateway") or {}
    return f"{_num(gw.get('cpu_share'), 2)}, {_pair(gw.get('loop_lag_ms'), 1)}"


def _big_steps(run: dict[str, Any]) -> str:
    """The top tenth of the unit steps (where the P8 gaps come from): their mean, then what each stage added."""
    big = (run.get("unit_step_sources_ms") or {}).get("big") or {}
    parts = " / ".join(_num(big.get(k), 0) for k in ("stage0", "tts", "token2wav", "rest"))
    return f"{_num(big.get('step'), 0)}: {parts}"


def _markdown(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def table(files: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [f"- {name}: commit {doc.get('commit', '-')}, profile {doc.get('profile', '-')}, {doc.get('device', '-')}"
             for name, doc in files]
    runs = [(name, run) for name, doc in files for run in doc.get("runs", [])]
    lines += ["", *_markdown(COLUMNS, [row(name, run) for name, run in runs])]
    lines += ["", *_markdown(POSITION_COLUMNS, [position_row(name, run) for name, run in runs])]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> list[tuple[str, Path]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="NAME=PATH or PATH (the name is the file's stem)")
    out = []
    for item in ap.parse_args(argv).files:
        name, sep, path = item.partition("=")
        out.append((name, Path(path)) if sep else (Path(item).stem, Path(item)))
    return out


def main(argv: list[str] | None = None) -> None:
    print(table([(name, json.loads(path.read_text())) for name, path in parse_args(argv)]))


if __name__ == "__main__":
    main()
