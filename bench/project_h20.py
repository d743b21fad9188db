"""H20 projection (issue 15): GPU time per real-time second from the H200 measurements and a roofline.

    python bench/project_h20.py            # the tables of docs/deploy.md §7.5, in markdown

No H20 has been lent: every figure here is a PROJECTION. Inputs are the H200 figures of bench/RESULTS.md
(named below with their rows) and data-sheet peaks. Per real-time second, in the worst case that every one
of N sessions speaks, one GPU runs in sequence (all three stages share it):

    T(N, W) = FE(N) + PF(N, W) + D · DEC(N, W) + TTS(N) + T2W(N)      D = max_steps = 20 decode steps

Each H200 time is split into its roofline floor and the rest (host work, launches, kernel efficiency),
which is kept as measured; on the H20 the floor is recomputed:
  * bandwidth-bound (LLM decode, TTS steps): bytes / BW, BW ratio H200 measured 4.24 TB/s : H20 4.0 TB/s
    data sheet = 1.06 (if the H20 reaches the same 88 % of its data sheet as the H200 did, 1.2);
  * compute-bound (unit prefill, Whisper front end, flow DiT): FLOPs / peak, H200 989 : H20 148 dense
    bf16/fp16 TFLOP/s = 6.7: t_H20 = t_H200 + FLOPs · (1 / F_H20 - 1 / F_H200).
The H200 front end is not measured yet: its 15 ms target for 64 units stands in (scaled by N / 64).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

MS = 1e3
BW_H200 = 4.24e12  # B/s, measured on the lent H200 (bench_stage0 floor)
BW_H20 = 4.0e12  # B/s, data sheet
F_H200 = 989e12  # dense bf16 FLOP/s, data sheet
F_H20 = 148e12
LLM_WEIGHT_BYTES = 8_189_195_264 * 2  # model.md §1.1, bf16
LLM_FLOPS_PER_POS = 2 * 8_189_195_264
KV_BYTES_PER_POS = 147_456  # docs/deploy.md §7.1 b_llm
UNIT_POSITIONS = 13  # merged close + `<unit>` + 10 audio embeddings (bench_stage0 MERGED_PREFILL)
MEASURED_CONTEXT = 2048  # the context of the H200 engine-step rows
DECODE_STEPS = 20  # DecodeRules.max_steps: the worst case, every unit a full speak unit
# Whisper-medium per unit: 2 · 307.2 M params · 50 frames + attention over up to 1500 cached frames + projector
FE_FLOPS_PER_UNIT = 2 * 307_216_384 * 50 + 24 * 4 * 50 * 1500 * 1024 + 2 * 20_979_712 * 50
FE_H200_MS_AT_64 = 15.0  # issue 15 target, stands in until measured
# flow DiT per session chunk: 2 · ~100 M params · 50 new frames · 5 Euler steps · 2 (CFG) + attention
DIT_FLOPS_PER_CHUNK = 2 * 100e6 * 50 * 5 * 2 + 16 * 2 * 5 * 4 * 50 * 650 * 512
BUDGET_MS = 800.0  # of each real-time second: 20 % left for jitter, the host and the gateway


def interp(points: dict[int, float], n: int) -> float:
    """Piecewise-linear in the batch size through measured (batch -> ms) points, extended past the last two."""
    xs = sorted(points)
    lo = max([x for x in xs if x <= n] or [xs[0]])
    hi = min([x for x in xs if x > lo] or [xs[-1]])
    if hi == lo:
        lo = xs[-2]
    return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)


# H200, bench/RESULTS.md (medians, ms)
DEC_H200 = {1: 13.1, 32: 29.9}  # "engine step() decode", commit 5f0127e, context 2048
PF_H200 = {1: 16.7, 32: 89.9}  # "engine step() prefill", same run
TTS_H200 = {1: 30.8, 8: 32.5, 32: 43.3}  # TTS unit, compile + graph
T2W_H200 = {1: 22.1, 8: 34.9, 32: 81.7}  # Token2Wav chunk, fp16 flow, pool graphs (h200 profile)


def _llm_bytes(n: int, ctx: int) -> float:
    return LLM_WEIGHT_BYTES + n * ctx * KV_BYTES_PER_POS


@dataclass(frozen=True)
class Gpu:
    name: str
    bw: float
    flops: float


H200 = Gpu("H200", BW_H200, F_H200)
H20 = Gpu("H20", BW_H20, F_H20)


def decode_ms(gpu: Gpu, n: int, window: int) -> float:
    rest = interp(DEC_H200, n) - _llm_bytes(n, MEASURED_CONTEXT) / BW_H200 * MS
    return rest + _llm_bytes(n, window) / gpu.bw * MS


def prefill_ms(gpu: Gpu, n: int, window: int) -> float:
    flops = n * UNIT_POSITIONS * LLM_FLOPS_PER_POS
    extra_kv = n * (window - MEASURED_CONTEXT) * KV_BYTES_PER_POS / gpu.bw * MS
    return interp(PF_H200, n) + flops * (1 / gpu.flops - 1 / F_H200) * MS + extra_kv


def frontend_ms(gpu: Gpu, n: int) -> float:
    return FE_H200_MS_AT_64 * n / 64 + n * FE_FLOPS_PER_UNIT * (1 / gpu.flops - 1 / F_H200) * MS


def tts_ms(gpu: Gpu, n: int) -> float:
    return interp(TTS_H200, n) * BW_H200 / gpu.bw


def t2w_ms(gpu: Gpu, n: int) -> float:
    return interp(T2W_H200, n) + n * DIT_FLOPS_PER_CHUNK * (1 / gpu.flops - 1 / F_H200) * MS


def per_second(gpu: Gpu, n: int, window: int) -> dict[str, float]:
    parts = {"front end": frontend_ms(gpu, n), "unit prefill": prefill_ms(gpu, n, window),
             f"{DECODE_STEPS} decode steps": DECODE_STEPS * decode_ms(gpu, n, window),
             "TTS unit": tts_ms(gpu, n), "Token2Wav chunk": t2w_ms(gpu, n)}
    return {**parts, "total": sum(parts.values())}


def max_sessions(gpu: Gpu, window: int, budget_ms: float = BUDGET_MS) -> int:
    n = 0
    while per_second(gpu, n + 1, window)["total"] <= budget_ms:
        n += 1
    return n


def render(sessions: tuple[int, ...] = (16, 24, 32), windows: tuple[int, ...] = (8192, 4096)) -> str:
    lines = ["| GPU | sessions | KV window | " + " | ".join(per_second(H200, 1, 8192)) + " |",
             "| --- | ---: | ---: |" + " ---: |" * len(per_second(H200, 1, 8192))]
    for gpu in (H200, H20):
        for w in windows:
            for n in sessions:
                row = per_second(gpu, n, w)
                lines.append(f"| {gpu.name} | {n} | {w} | " + " | ".join(f"{v:.0f}" for v in row.values()) + " |")
    lines += ["", f"| GPU | KV window | max sessions with T(N) <= {BUDGET_MS:.0f} ms |", "| --- | ---: | ---: |"]
    lines += [f"| {gpu.name} | {w} | {max_sessions(gpu, w)} |" for gpu in (H200, H20) for w in windows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(render(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
