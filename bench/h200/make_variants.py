"""The variant profiles of bench/h200/README.md's latest device plan, made here before the call (they travel untracked
and are checked as `duplex serve` checks a profile, by variant_profile.py's `variant`):

    python bench/h200/make_variants.py [DIR]      # default deploy/profiles

Delete them before committing or running the tests (the tests read every profile in deploy/profiles).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("variant_profile", Path(__file__).with_name("variant_profile.py"))
variant_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variant_profile)

PROFILES = ROOT / "deploy" / "profiles"
# (name, base: a shipped profile or an earlier name, settings); in order, each base made before it is used
VARIANTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # the 64-slot profile with h200-scripted's stage0 / TTS / Token2Wav settings (stops 44-51)
    ("ab-64s", "h200-64-scripted", (
        "engine_options.stage0.decode_attention=flex", "engine_options.stage0.flex_prefill_keys_per_split=2048",
        "engine_options.stage0.mixed_step=shared", "engine_options.stage0.gemm_tile_rows=128",
        "engine_options.stage0.shared_decode_buckets=[2,4,8,16,32,64]", "engine_options.stage0.flex_prefill_warps=4",
        "engine_options.stage0.flex_prefill_stages=2", "engine_options.tts.first_codes=8",
        "engine_options.tts.gemm_tile_rows=32", "engine_options.tts.continuous=true",
        "engine_options.token2wav.compile_flow=true", "engine_options.token2wav.compile_hift=true")),
    ("ab-64pb", "ab-64s", ("engine_options.stage0.prefill_batch_buckets=[2,4,8,16,32,64]",)),
    ("ab-64pbm", "ab-64pb", ("unit_align_min_sessions=24",)),             # aligned above 24 live sessions
    ("ab-64pbmh", "ab-64pbm", ("engine_options.tts.head_every_unit=true",)),
    ("ab-64u", "ab-64pb", ("unit_align_s=0",)),                            # unaligned
    ("ab-64uh", "ab-64u", ("engine_options.tts.head_every_unit=true",)),
    # 32 slots on an 80 GB H100 (stop 54): h200-scripted's window cut to 4096; with (as the profile) and without heads
    ("ab-u32h", "h200-scripted", ("kv_window=4096", "engine_options.tts.max_turn_positions=4096")),
    ("ab-u32", "ab-u32h", ("engine_options.tts.head_every_unit=false",)),
    # 48 slots on an 80 GB H100 (stop 56): the window cut to 2048, unaligned and aligned above 24 live, both with heads
    ("ab-u48h", "h200-scripted", ("max_sessions=48", "kv_window=2048", "engine_options.tts.max_turn_positions=2048",
                                  "engine_options.stage0.shared_decode_buckets=[2,4,8,16,32,64]")),
    ("ab-a48h", "ab-u48h", ("unit_align_s=1.0", "unit_align_min_sessions=24",
                            "engine_options.stage0.prefill_batch_buckets=[2,4,8,16,32,64]")),
    # the units that wait behind token rows go together once the oldest is 40 ms old (stop 60), at 48 and 64 slots
    ("ab-u48hg", "ab-u48h", ("engine_options.stage0.prefill_hold_ms=40",)),
    ("ab-64uhg", "ab-64uh", ("engine_options.stage0.prefill_hold_ms=40",)),
    # the served figure at 16 on an 80 GB H100 (stop 57): h200-scripted's 32 slots at 8 k do not fit, 16 do
    ("ab-16", "h200-scripted", ("max_sessions=16",)),
)


def make(out_dir: Path) -> list[Path]:
    made: dict[str, Path] = {}
    for name, base, settings in VARIANTS:
        out = out_dir / f"{name}.yaml"
        variant_profile.variant(made.get(base, PROFILES / f"{base}.yaml"), out, list(settings))
        made[name] = out
    return list(made.values())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    for path in make(Path(args[0]) if args else PROFILES):
        print(path)


if __name__ == "__main__":
    main()
