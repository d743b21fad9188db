"""Frozen Stage1 (TTS engine) settings; sampling defaults from model.md §5.3/§5.4."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TTSEngineConfig:
    max_sessions: int = 64
    max_batch: int = 32
    # positions per turn (model.md §5.2: tts_max_turn_positions); also the KV length per slot
    max_turn_positions: int = 8192
    temperature: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 16
    # samples per unit; the last one is discarded, so a unit without EOS returns max_new_tokens - 1 codes
    max_new_tokens: int = 26
    use_cuda_graphs: bool = True
    # torch.compile the single-code step's decoder layers before graph capture (regional compilation: a
    # couple of compiles for all buckets; on CPU the warm-up compiles ahead, no graphs). Needed for the
    # 40 ms TTS unit at batch 1 (targets.md P4) on an H200 (one unit 31 ms vs 65 ms graph-only, whole-step
    # compile); fused kernels round differently from eager, so exact graph == eager (I10) holds for the
    # uncompiled graph only.
    compile_step: bool = False
    # q/k/v and gate/up as one matmul each (`TTSModel.fuse_projections`, applied at engine start): the step is
    # latency-bound by its ~20 kernels per layer (bench/RESULTS.md stop 24: 416 per step, 2.6 us each), and
    # fusing drops four GEMM launches per layer
    fuse_projections: bool = True
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    # condition-row counts (n + 1) with a captured prefill graph; longer units prefill eagerly
    row_buckets: tuple[int, ...] = (8, 16, 32, 64)
    # smallest attended-key bucket; buckets double up to max_turn_positions
    min_kv_bucket: int = 256
    # false reproduces the reference: a Stage0 turn start does not reset a TTS turn left open (Q13)
    turn_start_resets_kv: bool = False
    # codes of a turn's first unit sent as soon as they are sampled (the "head"), before the unit ends: the
    # vocoder starts that much earlier after the user stops (targets.md P7). 0 = off: each unit sent whole.
    first_codes: int = 0
    # with first_codes: every unit sends its first codes early, not only a turn's first. The next unit's audio then
    # starts (first_codes x 40 ms of it) while its remaining codes are drawn, so the pause between two units' audio
    # shrinks by those draws (the P8 chunk gaps). Token2Wav renders each unit in two calls instead of one
    head_every_unit: bool = False
    # every TTS GEMM on exactly this many rows, fewer padded, more in chunks (`TTSModel.tile_gemm_rows`; 0 = off):
    # a session's codes then do not depend on who shares its step (on the H200 they did from 8 sessions on,
    # bench/tts_batch_invariance.py; bench/RESULTS.md stop 38). On in the h200 profiles.
    gemm_tile_rows: int = 0
    # continuous batching: `TTSEngine.step` runs one single-code step, and a queued unit joins the next one
    # (its prefill first) instead of waiting for the units in flight to finish their 26 samples; a unit leaves
    # as soon as its own samples are drawn. The codes are the same either way. False: a step runs whole units.
    continuous: bool = False

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_batch", "max_turn_positions", "repetition_window",
                     "max_new_tokens", "min_kv_bucket"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TTSEngineConfig.{name}: must be > 0")
        if self.temperature <= 0 or self.repetition_penalty <= 0:
            raise ValueError("TTSEngineConfig: temperature and repetition_penalty must be > 0")
        if list(self.batch_buckets) != sorted(self.batch_buckets) or self.batch_buckets[-1] < self.max_batch:
            raise ValueError("TTSEngineConfig.batch_buckets: must be ascending and reach max_batch")
        if self.gemm_tile_rows < 0:
            raise ValueError(f"TTSEngineConfig.gemm_tile_rows: must be >= 0, got {self.gemm_tile_rows}")
        if not 0 <= self.first_codes <= self.max_new_tokens - 2:  # a full unit keeps at least one code for the rest
            raise ValueError(f"TTSEngineConfig.first_codes: must be in [0, max_new_tokens - 2 = "
                             f"{self.max_new_tokens - 2}]")
        if self.head_every_unit and not self.first_codes:
            raise ValueError("TTSEngineConfig.head_every_unit: needs first_codes > 0")

    def batch_bucket(self, b: int) -> int:
        return next(x for x in self.batch_buckets if x >= b)

    def kv_bucket(self, needed: int) -> int:
        """Smallest power-of-two multiple of min_kv_bucket ≥ needed, capped at max_turn_positions."""
        size = self.min_kv_bucket
        while size < needed:
            size *= 2
        return min(size, self.max_turn_positions)
