#!/usr/bin/env bash
# The variant profiles of bench/h200/README.md's latest device plan, made here before the call (they travel untracked
# and are checked as `duplex serve` checks a profile): bash bench/h200/make_variants.sh [DIR] (default deploy/profiles).
# Delete them before committing or running the tests (the tests read every profile in deploy/profiles).
set -euo pipefail
cd "$(dirname "$0")/../.."
D="${1:-deploy/profiles}"
V() { .venv/bin/python bench/h200/variant_profile.py "$@" >/dev/null; echo "$2"; }
# the 64-slot profile with h200-scripted's stage0 / TTS / Token2Wav settings (stops 44-51), prefill buckets to 64
V deploy/profiles/h200-64-scripted.yaml "$D/ab-64s.yaml" engine_options.stage0.decode_attention=flex \
  engine_options.stage0.flex_prefill_keys_per_split=2048 engine_options.stage0.mixed_step=shared \
  engine_options.stage0.gemm_tile_rows=128 'engine_options.stage0.shared_decode_buckets=[2,4,8,16,32,64]' \
  engine_options.stage0.flex_prefill_warps=4 engine_options.stage0.flex_prefill_stages=2 \
  engine_options.tts.first_codes=8 engine_options.tts.gemm_tile_rows=32 engine_options.tts.continuous=true \
  engine_options.token2wav.compile_flow=true engine_options.token2wav.compile_hift=true
V "$D/ab-64s.yaml" "$D/ab-64pb.yaml" 'engine_options.stage0.prefill_batch_buckets=[2,4,8,16,32,64]'
V "$D/ab-64pb.yaml" "$D/ab-64pbm.yaml" unit_align_min_sessions=24          # aligned above 24 live sessions
V "$D/ab-64pbm.yaml" "$D/ab-64pbmh.yaml" engine_options.tts.head_every_unit=true
V "$D/ab-64pb.yaml" "$D/ab-64u.yaml" unit_align_s=0                        # unaligned
V "$D/ab-64u.yaml" "$D/ab-64uh.yaml" engine_options.tts.head_every_unit=true
# 32 slots on an 80 GB H100 (stop 54): h200-scripted's window cut to 4096; with (h, as the profile) and without heads
V deploy/profiles/h200-scripted.yaml "$D/ab-u32h.yaml" kv_window=4096 engine_options.tts.max_turn_positions=4096
V "$D/ab-u32h.yaml" "$D/ab-u32.yaml" engine_options.tts.head_every_unit=false
