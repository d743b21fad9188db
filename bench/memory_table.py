"""GPU memory per session and sessions per GPU, from the formulas of docs/deploy.md (model.md §7).

    python bench/memory_table.py                 # the tables of docs/deploy.md, in markdown
    python bench/memory_table.py --prompt-s 5 --reserve-gib 12
    python bench/memory_table.py --measured mem.json   # sessions per GPU from bench/bench_stage_memory.py
    python bench/memory_table.py --measured s0.json tts.json t2w.json   # the same, one run per stage

Every figure is derived (model.md tag [D]) from the model dimensions of model.md §1 and the engines'
own configuration defaults: `Stage0Config.slot_len` (LLM KV reserved per session), `TTSEngineConfig.
max_turn_positions` (TTS KV reserved per session), `StreamConfig` (Euler steps, kept frames) and
`FlowConfig` (Token2Wav sizes). Nothing here is measured; measured figures belong in bench/RESULTS.md.
docs/deploy.md embeds this script's output verbatim and tests/deploy/test_memory_table.py keeps them equal.
With `--measured` the shared part is measured instead (`render_measured`): each stage process's device
memory after warm-up minus the session state it preallocated, plus the derived per-session bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from engine.stage0.config import DecodeRules, Stage0Config  # noqa: E402
from engine.stage1.config import TTSEngineConfig  # noqa: E402
from engine.token2wav.config import FlowConfig, StreamConfig  # noqa: E402

GiB = 1024**3
MiB = 1024**2
BF16, FP32 = 2, 4
KV = 2  # one K and one V per position


@dataclass(frozen=True)
class ModelDims:
    """Full-size MiniCPM-o 4.5 dimensions (model.md §1.1-§1.7)."""

    llm_layers: int = 36
    llm_kv_heads: int = 8
    llm_head_dim: int = 128
    audio_layers: int = 24
    audio_d_model: int = 1024
    audio_max_frames: int = 1500     # Whisper max_source_positions: the audio KV bound (§7.1)
    tts_layers: int = 20
    tts_kv_dim: int = 768            # 12 KV heads x 64
    # parameter counts of §1.1: llm + apm + projector + vpm (26 layers) + resampler + tts, run in bf16
    bf16_params: int = 8_189_195_264 + 307_216_384 + 20_979_712 + 402_552_736 + 88_907_776 + 347_696_290
    llm_params: int = 8_189_195_264  # read once per LLM forward (§10)
    fp32_params: int = 155_802_352 + 20_821_295  # Token2Wav flow + HiFT
    tokens_per_s: int = 25           # S3 codes per second of voice prompt (P = 2 x tokens, §0.4)
    conformer_cnn_frames: int = 6    # 2 pre-lookahead + 4 upsample history frames (§6.2)
    hift_state_bytes: int = (8 * 80 + 3840 + 3840) * FP32  # mel, source and speech tails (§6.5 step 6)


@dataclass(frozen=True)
class Gpu:
    name: str
    total_mib: int   # nvidia-smi "Memory-Usage" total
    hbm_tb_s: float  # peak HBM bandwidth, data sheet


GPUS = (Gpu("H20", 97_871, 4.0), Gpu("H100 SXM 80GB", 81_559, 3.35), Gpu("H200", 143_771, 4.8))


@dataclass(frozen=True)
class Assumptions:
    prompt_s: float = 10.0      # voice prompt length (model.md §9.5 dummy voice: 10 s, P = 500)
    voices: int = 1             # distinct voices with a resident base cache
    reserve_gib: float = 8.0    # CUDA context, activations, graph pools, allocator slack: ASSUMED, not measured


@dataclass(frozen=True)
class Sizing:
    """Per-position/per-frame bytes and the per-session and shared memory they add up to."""

    dims: ModelDims
    stage0: Stage0Config
    rules: DecodeRules
    tts: TTSEngineConfig
    stream: StreamConfig
    flow: FlowConfig
    assume: Assumptions

    # ---- bytes per position / frame (model.md §7.1) ----
    @property
    def llm_per_pos(self) -> int:
        d = self.dims
        return d.llm_layers * KV * d.llm_kv_heads * d.llm_head_dim * BF16

    @property
    def audio_per_frame(self) -> int:
        return self.dims.audio_layers * KV * self.dims.audio_d_model * BF16

    @property
    def tts_per_pos(self) -> int:
        return self.dims.tts_layers * KV * self.dims.tts_kv_dim * BF16

    @property
    def t2w_per_frame(self) -> int:
        """Estimator attention (per Euler step, CFG pair) + conformer attention, fp32, per mel frame."""
        f, n_ts = self.flow, self.stream.n_timesteps
        estimator = n_ts * f.dit_depth * 2 * f.dit_heads * KV * f.dit_head_dim * FP32
        conformer = (f.enc_blocks + f.enc_up_blocks) * f.enc_heads * KV * (f.enc_dim // f.enc_heads) * FP32
        return estimator + conformer

    # ---- positions and frames ----
    @property
    def llm_slot_positions(self) -> int:
        return self.stage0.slot_len(self.rules)

    @property
    def prompt_frames(self) -> int:
        return round(2 * self.dims.tokens_per_s * self.assume.prompt_s)

    @property
    def t2w_frames(self) -> int:
        """P + kept history + one call's new frames: T <= P + 150 at the defaults (§6.9)."""
        new = self.flow.up_stride * self.stream.chunk_new
        return self.prompt_frames + self.stream.cache_keep_frames + new

    # ---- per session ----
    def per_session(self) -> dict[str, int]:
        f, n_ts = self.flow, self.stream.n_timesteps
        small = (n_ts * f.dit_depth * 2 * 2 * f.dit_hidden * (f.dit_conv_kernel - 1) * FP32
                 + f.enc_dim * self.dims.conformer_cnn_frames * FP32 + self.dims.hift_state_bytes)
        return {
            "LLM KV (slot)": self.llm_slot_positions * self.llm_per_pos,
            "audio KV": self.dims.audio_max_frames * self.audio_per_frame,
            "TTS KV (slot)": self.tts.max_turn_positions * self.tts_per_pos,
            "Token2Wav turn state": self.t2w_frames * self.t2w_per_frame + small,
        }

    # ---- shared ----
    def shared(self) -> dict[str, int]:
        d = self.dims
        return {
            "weights": d.bf16_params * BF16 + d.fp32_params * FP32,
            "voice base caches": self.assume.voices * self.prompt_frames * self.t2w_per_frame,
            "scratch slots": self.llm_slot_positions * self.llm_per_pos + self.tts.max_turn_positions * self.tts_per_pos,
            "reserve (assumed)": round(self.assume.reserve_gib * GiB),
        }

    def max_sessions(self, gpu: Gpu) -> int:
        free = gpu.total_mib * MiB - sum(self.shared().values())
        return max(0, free // sum(self.per_session().values()))

    def llm_floor_ms_per_s(self, gpu: Gpu, sessions: int) -> float:
        """HBM floor of the LLM alone for one real-time second when every session speaks with a full window:
        (max_steps + prefill + close) sequential forwards, each reading the weights once plus every KV slot."""
        steps = self.rules.max_steps + 2
        per_step = self.dims.llm_params * BF16 + sessions * self.stage0.window_high * self.llm_per_pos
        return steps * per_step / (gpu.hbm_tb_s * 1e12) * 1e3


def default_sizing(assume: Assumptions | None = None, window: tuple[int, int] | None = None,
                   tts_positions: int | None = None) -> Sizing:
    """The engines' defaults, optionally with another eviction window (high, low) or TTS slot length."""
    stage0 = Stage0Config() if window is None else Stage0Config(window_high=window[0], window_low=window[1])
    tts = TTSEngineConfig() if tts_positions is None else TTSEngineConfig(max_turn_positions=tts_positions)
    return Sizing(ModelDims(), stage0, DecodeRules(), tts, StreamConfig(), FlowConfig(), assume or Assumptions())


# What-if rows of the levers table: (label, eviction window (high, low) or None, TTS slot positions or None).
LEVERS = (
    ("engine defaults", None, None),
    ("TTS slot 4096 (model.md §5.2 nominal turn)", None, 4096),
    ("TTS slot 4096, window 6000/4500", (6000, 4500), 4096),
    ("TTS slot 4096, window 4000/3500 (reference kwargs)", (4000, 3500), 4096),
)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def render(s: Sizing) -> str:
    """The markdown block docs/deploy.md embeds (between its memory_table markers)."""
    a = s.assume
    lines = [f"Inputs: LLM slot {s.llm_slot_positions} positions (window_high {s.stage0.window_high} + one "
             f"unit's max {s.stage0.unit_max_positions(s.rules)}, rounded up to a multiple of {s.stage0.span_align}, "
             f"+ 1), TTS slot {s.tts.max_turn_positions} "
             f"positions, n_ts = {s.stream.n_timesteps}, voice prompt {a.prompt_s:g} s (P = {s.prompt_frames}), "
             f"{a.voices} voice(s), reserve {a.reserve_gib:g} GiB (assumed).", "",
             "| per session | bytes per position / frame | positions / frames | GiB |", "| --- | ---: | ---: | ---: |"]
    per, units = s.per_session(), [s.llm_per_pos, s.audio_per_frame, s.tts_per_pos, s.t2w_per_frame]
    counts = [s.llm_slot_positions, s.dims.audio_max_frames, s.tts.max_turn_positions, s.t2w_frames]
    for (name, total), unit, count in zip(per.items(), units, counts, strict=True):
        lines.append(f"| {name} | {unit:,} | {count:,} | {_gib(total)} |")
    lines.append(f"| **total per session** | | | **{_gib(sum(per.values()))}** |")
    lines += ["", "| shared per GPU | GiB |", "| --- | ---: |"]
    lines += [f"| {name} | {_gib(v)} |" for name, v in s.shared().items()]
    lines += ["", "| GPU | memory (GiB) | max sessions by memory | LLM HBM floor per real-time second at that "
              "count, all speaking (ms) |", "| --- | ---: | ---: | ---: |"]
    for gpu in GPUS:
        n = s.max_sessions(gpu)
        lines.append(f"| {gpu.name} | {gpu.total_mib * MiB / GiB:.1f} | {n} | {s.llm_floor_ms_per_s(gpu, n):.0f} |")
    lines += ["", "| lever (max sessions by memory) | GiB per session | " + " | ".join(g.name for g in GPUS) + " |",
              "| --- | ---: |" + " ---: |" * len(GPUS)]
    for label, window, tts_positions in LEVERS:
        v = default_sizing(s.assume, window, tts_positions)
        counts = " | ".join(str(v.max_sessions(g)) for g in GPUS)
        lines.append(f"| {label} | {_gib(sum(v.per_session().values()))} | {counts} |")
    return "\n".join(lines) + "\n"


def render_measured(s: Sizing, measured: dict) -> str:
    """Sessions per GPU from bench/bench_stage_memory.py's JSON: N = floor((M_gpu - F) / S_session), where
    F = sum over the stage processes of (device memory used after warm-up - preallocated session state),
    S_session = the preallocated session state / max_sessions (LLM slot, TTS slot, Token2Wav pool, as
    the engines allocate them), the audio KV among it when stage0 pools it (`audio_kv_pooled`, since issue 15),
    else + the audio KV each session allocated when it opened (1500 frames; older measurements)."""
    stages = measured["stages"]
    sessions = stages[0]["settings"]["max_sessions"]
    fixed = sum(r["fixed"] for r in stages)
    pooled = any(r.get("audio_kv_pooled") for r in stages)
    audio = 0 if pooled else s.per_session()["audio KV"]
    per_session = sum(r["preallocated"] for r in stages) / sessions + audio
    lines = [f"Measured on {measured['device']} with {measured['profile']} (max_sessions {sessions}).", "",
             "| stage process | used after load | used after warm-up | preallocated session state | fixed F |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in stages:
        lines.append(f"| {r['stage']} | {_gib(r['after_load']['device_used'])} | "
                     f"{_gib(r['after_warm_up']['device_used'])} | {_gib(r['preallocated'])} | {_gib(r['fixed'])} |")
    lines += [f"| **sum** | | | | **{_gib(fixed)}** |", "",
              f"Per session: {_gib(per_session)} GiB (preallocated state / {sessions}"
              + (", the pooled audio KV among it)." if pooled else f" + audio KV {_gib(audio)})."), "",
              "| GPU | memory (GiB) | max sessions by memory (measured F) |", "| --- | ---: | ---: |"]
    for gpu in GPUS:
        n = max(0, int((gpu.total_mib * MiB - fixed) // per_session))
        lines.append(f"| {gpu.name} | {gpu.total_mib * MiB / GiB:.1f} | {n} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-s", type=float, default=Assumptions.prompt_s, help="voice prompt seconds")
    ap.add_argument("--voices", type=int, default=Assumptions.voices, help="resident voices")
    ap.add_argument("--reserve-gib", type=float, default=Assumptions.reserve_gib, help="non-KV runtime reserve")
    ap.add_argument("--measured", type=Path, nargs="+", default=None,
                    help="JSON of bench/bench_stage_memory.py (several: their stages together, e.g. one per stage)")
    args = ap.parse_args(argv)
    if args.measured is not None:
        runs = [json.loads(path.read_text()) for path in args.measured]
        merged = {**runs[0], "stages": [stage for run in runs for stage in run["stages"]]}
        print(render_measured(default_sizing(), merged), end="")
        return 0
    print(render(default_sizing(Assumptions(args.prompt_s, args.voices, args.reserve_gib))), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
