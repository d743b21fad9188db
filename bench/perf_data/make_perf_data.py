"""Write the perf_analyzer input-data files (sequences for the `duplex` pipeline and `stage0`).

    python bench/perf_data/make_perf_data.py   # rewrites bench/perf_data/*.json

One stream = one session: open, N appends (unit 0 is 1030 ms, then 1 s units of 16 kHz PCM), close.
perf_analyzer sets START on the first and END on the last step of each sequence. The audio is a
square wave (a loud unit) or silence, kept small as JSON text.
"""

from __future__ import annotations

import json
from pathlib import Path

FIRST_UNIT_SAMPLES = 16_480
UNIT_SAMPLES = 16_000
SQUARE_PERIOD = 80  # samples: a 200 Hz square wave at 16 kHz
AMPLITUDE = 0.1
HERE = Path(__file__).resolve().parent


def unit_pcm(n: int, loud: bool) -> list[float]:
    if not loud:
        return [0.0] * n
    return [AMPLITUDE if (i // (SQUARE_PERIOD // 2)) % 2 == 0 else -AMPLITUDE for i in range(n)]


def session(units: int, loud_pattern: tuple[bool, ...]) -> list[dict[str, object]]:
    steps: list[dict[str, object]] = [{"OP": ["open"], "FENCE": [1, 1, 0], "CONFIG": ['{"voice": "default"}']}]
    for u in range(units):
        n = FIRST_UNIT_SAMPLES if u == 0 else UNIT_SAMPLES
        pcm = unit_pcm(n, loud_pattern[u % len(loud_pattern)])
        steps.append({"OP": ["append"], "FENCE": [1, 1, u + 1], "PCM": {"content": pcm, "shape": [n]}})
    steps.append({"OP": ["close"], "FENCE": [1, 1, 0]})
    return steps


def main() -> None:
    data = {"data": [session(2, (True, False))]}
    (HERE / "session_2units.json").write_text(json.dumps(data, separators=(",", ":")))
    print(f"wrote {HERE / 'session_2units.json'}")


if __name__ == "__main__":
    main()
