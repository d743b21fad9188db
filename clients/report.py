"""Human-readable rendering of an `EventCollector` summary (used by the CLI and the examples)."""

from __future__ import annotations

from typing import Any

LATENCY_NAMES = ("commit_to_first_audio_ms", "speech_end_to_first_audio_ms", "response_created_to_first_audio_ms",
                 "cancel_to_last_audio_ms", "max_chunk_gap_ms", "max_underrun_ms", "total_underrun_ms")


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        if not value.get("count"):
            return "-"
        return f"n={value['count']} mean={value['mean']:.1f} p95={value['p95']:.1f} max={value['max']:.1f}"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def format_response(r: dict[str, Any]) -> list[str]:
    head = f"{r['response_id']}  {r.get('status', 'open')}/{r.get('reason', '-')}  audio {r['audio_ms']:.0f} ms"
    lines = [head, f"  transcript: {r.get('transcript', '')!r}"]
    client = r["client"]
    for name in LATENCY_NAMES:
        if name in client:
            lines.append(f"  {name:<38}{_fmt(client[name])}")
    for name in ("inter_chunk_interval_ms", "chunk_duration_ms"):
        lines.append(f"  {name:<38}{_fmt(client[name])}")
    thinker = (r.get("engine") or {}).get("0")
    if thinker:
        lines.append(f"  engine thinker ttft_ms / tpot_ms         {_fmt(thinker.get('ttft_ms'))} / "
                     f"{_fmt(thinker.get('tpot_ms'))}")
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"timings (client monotonic clock), {len(summary['responses'])} response(s):"]
    for r in summary["responses"]:
        lines.extend(format_response(r))
    if summary.get("barge_in_to_cleared_ms"):
        lines.append(f"barge_in_to_cleared_ms: {summary['barge_in_to_cleared_ms']}")
    for path in summary.get("files", []):
        lines.append(f"wrote {path}")
    return "\n".join(lines)
