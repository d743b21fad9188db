"""Stage0 configuration, special ids and the tokenizer seam (model.md §3.2, §3.4, §3.9, §4, §7.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

CLOSE_POSITIONS = 2  # a unit closes with `[terminator, </unit>]`, fed together (model.md §3.6)
# torch.compile modes that leave graph capture to the engine (the others capture CUDA graphs themselves)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class ScriptPlan:
    """The cycle of a `scripted_decisions` session (model.md §9.5; engine/stage0/script.py plays it)."""

    listen_units: int = 10
    speak_units: int = 5
    text_ids_per_unit: int = 4
    tail_listen_units: int = 5

    @property
    def cycle(self) -> int:
        return self.listen_units + self.speak_units + self.tail_listen_units


class TextTokenizer(Protocol):
    """What Stage0 needs from a tokenizer. `decode` must skip special tokens."""

    def encode(self, text: str) -> list[int]: ...  # add_special_tokens=False; specials recognised
    def decode(self, ids: list[int]) -> str: ...
    def token_id(self, token: str) -> int: ...  # raises KeyError when missing
    @property
    def bad_token_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class SpecialIds:
    im_start: int
    im_end: int
    unit_open: int
    unit_close: int
    audio_start: int
    audio_end: int
    image_open: int
    image_close: int
    listen: int
    speak: int
    tts_bos: int
    chunk_eos: int
    chunk_tts_eos: int
    turn_eos: int
    tts_pad: int
    bad_token_ids: tuple[int, ...]

    @property
    def terminators(self) -> frozenset[int]:
        return frozenset((self.listen, self.chunk_eos, self.chunk_tts_eos))

    @classmethod
    def from_tokenizer(cls, tok: TextTokenizer, vocab_size: int) -> SpecialIds:
        names = {"im_start": "<|im_start|>", "im_end": "<|im_end|>", "unit_open": "<unit>",
                 "unit_close": "</unit>", "audio_start": "<|audio_start|>", "audio_end": "<|audio_end|>",
                 "image_open": "<image>", "image_close": "</image>", "listen": "<|listen|>",
                 "speak": "<|speak|>", "tts_bos": "<|tts_bos|>", "chunk_eos": "<|chunk_eos|>",
                 "chunk_tts_eos": "<|chunk_tts_eos|>", "turn_eos": "<|turn_eos|>", "tts_pad": "<|tts_pad|>"}
        values = {field: tok.token_id(token) for field, token in names.items()}
        bad = [i for i in (*values.values(), *tok.bad_token_ids) if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad} are outside the vocabulary ({vocab_size})")
        return cls(**values, bad_token_ids=tuple(tok.bad_token_ids))


@dataclass(frozen=True)
class DecodeRules:
    max_steps: int = 20  # max_new_speak_tokens_per_chunk
    max_speak_chars_per_unit: int = 28  # reject a token past 28 characters of unit text; 0 = off (Q5)
    force_listen_count: int = 3
    midturn_listen: Literal["tts_bos", "allow"] = "tts_bos"  # mid-turn listen fed as <|tts_bos|> (Q1)


@dataclass(frozen=True)
class Stage0Config:
    max_sessions: int = 8
    # §7.4 `basic` eviction: after a unit closes, drop whole old units while the cache exceeds `window_high`,
    # until it is at most `window_low`. "off" keeps everything up to `max_context`.
    eviction: Literal["basic", "off"] = "basic"
    window_high: int = 8000
    window_low: int = 6000
    max_context: int = 40960
    # The slot's top attention span (`reserved_pos`, where steady-state sessions decode) is rounded up to a
    # multiple of this. An odd span leaves the attention's [rows, L] scores rows unaligned for the GPU's
    # matmul and SDPA kernels: on the H200 at 8 k, span 8357 vs 8456 made a decode step 17.9 vs 7.6 ms at
    # batch 1 and 66.6 vs 18.7 ms at batch 32 (bench/RESULTS.md, stop 24). 1 keeps the exact length.
    span_align: int = 64
    first_unit_samples: int = 16480  # protocol: unit 0 carries 1030 ms
    unit_samples: int = 16000
    audio_embeddings_per_unit: int = 10
    frame_embeddings: int = 64  # resampler queries per camera frame
    # the current frame + the optional stacked previous one (protocol.md §9.4 V-2; model.md §1.4 says why 2)
    max_frames_per_unit: int = 2
    default_prompt: str = "Streaming Omni Conversation."
    empty_ref_audio_markers: bool = True  # empty audio markers in the prefix without a reference clip (Q25)
    # No batch-1 graph buckets (a lone row runs padded to 2): torch.compile specialises a size-1 batch even with
    # dynamic shapes, and that graph's bf16 kernels made a session's tokens differ alone vs among 31 others on
    # the H200 (ids from position 11); with 2 as the smallest bucket they are equal (bench/RESULTS.md, stop 25).
    decode_batch_buckets: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    # graph attention spans (decode and prefill); the slot length is added. Steady-state sessions sit between
    # `window_low` and `window_high`, hence the upper buckets.
    decode_kv_buckets: tuple[int, ...] = (1024, 2048, 4096, 6144)
    use_cuda_graphs: bool = True  # no-op off CUDA (unless `eager_replay_graphs`)
    # tests/debug: build the graph sets (buckets, static buffers, copy-in/out) but replay eagerly, any device
    eager_replay_graphs: bool = False
    # Unit prefills in CUDA graphs: rows per graph; the lengths are `prefill_lengths()`. () = eager prefill.
    prefill_batch_buckets: tuple[int, ...] = (2, 4, 8)  # no 1: see decode_batch_buckets
    # Attention of the unit prefill graphs: "gather" copies each row's KV span in every layer, then SDPA;
    # "flex" attends over the slot KV itself with FlexAttention (per-row key blocks, no copy; compiled on
    # CUDA); "auto" is flex on CUDA, gather elsewhere (eager FlexAttention materialises the scores).
    prefill_attention: Literal["auto", "gather", "flex"] = "auto"
    # Attention of the decode steps (single-token rows, row = slot): "matmul" reads every row's keys up to the
    # step's span bucket (the longest row's); "flex" reads each row's own key blocks (engine/model/flex.py), so a
    # step costs the sum of its rows' lengths, and one span serves every bucket (fewer graphs); "sdpa" as in
    # Qwen3LLM. Default matmul: on the H200 (stop 29, bench/RESULTS.md) the compiled flex graph was level with it
    # alone (8 k: 6.46 vs 6.14 ms at batch 1, 16.47 vs 16.52 at 32) and worse served at 64 sessions (max gap
    # 2371 vs 1447 ms, commit->first audio p99 2101 vs 1045 ms, same commit, only this option changed), and at 16
    # sessions on h200-scripted (324 vs 309 / 305 ms p50, stop 36). But at long spans with few rows flex is far
    # faster (8 k, one token among 16 slots: 6.4 vs 17.7 ms; the served load test stays under 2 k positions).
    # Matmul is not batch-invariant at full size (its batched GEMMs pick kernels by rows x kv heads: a row among 16
    # differed from the same row among 2 in bf16); flex is (each program reads one row's split of fixed length,
    # whatever the batch: engine/model/flex.py), so the h200 profiles set flex (bench/RESULTS.md stop 37; sessions
    # ~5 k deep: 275 vs 308 ms p50 at 16).
    decode_attention: Literal["matmul", "sdpa", "flex"] = "matmul"
    # Least rows of every LLM GEMM (`Qwen3LLM.pad_gemm_rows`; 0 = off): fewer rows are zero-padded. cuBLAS picks
    # its kernel by the row count: on the H200 in bf16 a row's logits alone differed from the same row among 1-63
    # others (max 0.0156) and were bit-equal with 32 rows padded, at no measured cost (decode step 8.45 vs 8.40
    # ms at 1 row, 25.3 vs 25.8 at 64; bench/bench_mixed_step.py "alone vs among", bench/RESULTS.md stop 36).
    # Logits are then batch-invariant; decode steps and unit prefills need `gemm_pad_buckets` and flex decode
    # attention too (below).
    gemm_min_rows: int = 32
    # Each CUDA graph pads its GEMMs further, to its set's largest bucket's rows rounded up to a power of two (up to
    # 128; engine/stage0/graphs.py): cuBLAS picks a GEMM kernel by its row count, and on the H200 in bf16 a decode
    # row among 64 differed from the same row among 2 (o_proj / down), a unit prefilled among 4 or 8 units from
    # the same unit among 2, even with 32 rows padded. With this and `decode_attention: flex` every decode,
    # logits and unit-prefill row read bit-equal alone and among 2-64 others in the compiled graphs at full size
    # (bench/bench_mixed_step.py with this rule, bench/batch_invariance_ops.py; bench/RESULTS.md stops 37-38).
    # The matmul decode attention stays batch-dependent (its batched GEMMs pick kernels by rows x kv heads).
    # Cost, served on h200-scripted at 16 sessions: commit->first audio p50 about +10-30 ms with flex (stops
    # 37-38: more GEMM work beside the TTS and Token2Wav steps); False keeps gemm_min_rows alone.
    gemm_pad_buckets: bool = True
    # Keys per split of the flex decoding kernel, which flex decode rows and unit prefills (at most 16 positions)
    # run on (engine/model/flex.py KEYS_PER_SPLIT, from an H200 sweep of 32 units at 8 k, stop 29); 0: torch's
    # split count (one split per row here: its batch is the cache's slots). Both are fixed per engine, so a row's
    # numbers stay independent of its batch either way. An A/B lever: the served step at 16 sessions slowed from
    # 02f129a to 5988a12, which brought this split (bench/RESULTS.md stop 42 item 3). Each split writes and reads
    # back fp32 partial results for every cache slot, 13 times more for a unit prefill than for a decode row
    # (flex.py `split_partials_bytes`), so unit prefills have their own length. Literals equal to flex.KEYS_PER_SPLIT:
    # this module stays free of torch.
    flex_keys_per_split: int = 512  # flex decode rows
    flex_prefill_keys_per_split: int = 512  # unit prefills (rows of 2-16 positions)
    # The same kernel's Triton warps and stages for unit prefills (0: torch's, 2 warps and 1 stage on sm_90, sized
    # for decode rows; engine/model/flex.py `decode_tuning`): fixed per engine like the split.
    flex_prefill_warps: int = 0
    flex_prefill_stages: int = 0
    # A step with both decoded tokens and unit prefills (or closes):
    # "split": the decode graph, then the prefill graph: two passes over the weights (at batch 1-2 either reads
    #   all 16 GB of bf16 weights).
    # "merge": the token rows ride in the prefill graph as rows of one position, while all fit its largest batch
    #   bucket. Served on the H200 at 16 / 32 sessions, A/B in one call: commit->first audio p50 291 -> 260 /
    #   466 -> 398 ms (bench/RESULTS.md, stop 35). But a token row's numbers then come from the prefill kernels
    #   whenever another session prefills in its step, and in bf16 that changed the ids a session draws (the
    #   H200 and CPU: tests/engine/test_stage0_bf16_batch.py), against "a session's output does not depend on
    #   its batch".
    # "shared": one pass (`SharedGraphs`, `Qwen3LLM.forward_shared`): the projections and MLP take all rows, the
    #   token rows attend as in their decode graph (same dense bucket, span and kernel), the unit rows as in the
    #   prefill graph. On CPU in bf16 the token rows' hidden states are bitwise split's (tests/engine/
    #   test_stage0_shared_pass.py, bench/bench_mixed_step.py; in fp32 some row counts round 2e-7 apart); on the
    #   GPU at full size they are not (max |diff| 0.09-0.16 in every mix of bench/bench_mixed_step.py: the GEMMs
    #   over all rows pick other kernels, and inductor's fusions round otherwise) unless `gemm_tile_rows` runs
    #   every GEMM on one row count; the compiled graphs round as eager does (graphs.compile_step). So tiled,
    #   its rows are split's bit for bit (H100, stop 45), and served at 16 sessions on an H100 it took
    #   commit->first audio p50 258 -> 219 and 263 -> 230 ms (bench/RESULTS.md stop 45; untiled on the H200 at
    #   stop 36: 290 against 309 / 305). The h200 profiles set both. With graphs only; steps with token rows
    #   past slot max(shared_decode_buckets) - 1, units with frames, or more units than the largest prefill
    #   bucket stay split.
    mixed_step: Literal["split", "merge", "shared"] = "split"
    # Every LLM GEMM and the lm_head as GEMMs of exactly this many rows (fewer padded, more in chunks:
    # `layers.linear`'s tile, as the TTS's `gemm_tile_rows`); 0: off (`gemm_min_rows` and `gemm_pad_buckets` rule).
    # A row's numbers then come from one kernel whatever shares its pass, so "shared" token rows equal their
    # decode graph's bit for bit (without it up to 0.03 apart at full width on an H100; bench/
    # bench_mixed_step.py --tile-rows). The cost: decode passes run this many rows (an H100 decode step 11.4 -> 11.9 ms
    # served at 16 sessions), and a pass past it reads the weights once per chunk; 128 stays under an H200's
    # ridge point (about 200 FLOP a byte).
    gemm_tile_rows: int = 0
    shared_decode_buckets: tuple[int, ...] = (2, 4, 8, 16)  # "shared": the dense buckets captured (x 5 spans)
    # torch.compile mode applied to the forward before graph capture ("default" or
    # "max-autotune-no-cudagraphs"); None = eager kernels. Only used where graphs are captured.
    compile_mode: str | None = None
    # q/k/v and gate/up as one matmul each (`Qwen3LLM.fuse_projections`, applied to the model at engine start)
    fuse_projections: bool = True
    # torch.compile `dynamic` of the compiled decoder layer (regional compilation, engine/stage0/graphs.py):
    # True makes batch, length and span symbolic from the first compile (a few compiles for every bucket);
    # None compiles the first shape static and recompiles with symbolic sizes; False compiles every graph
    # shape separately (slow capture, fastest kernels).
    compile_dynamic: bool | None = True
    # §3.6: defer `[terminator, </unit>]` and feed it in front of the next unit's prefill (one forward per
    # unit). UnitDone is emitted as soon as the terminator is known; the close is owed until then. Same ids
    # and hidden states as the separate close (tests/engine/test_stage0_merge.py), one forward fewer per unit.
    merge_unit_close: bool = True
    # Units one session may have queued (not yet started): about that many seconds of audio ahead of real
    # time. More is refused with CapacityError (runtime_backpressure): a flood of appends never piles up.
    max_queued_units: int = 32
    # Positions of a system prefix fed per step (0: the whole prefix in one step). A long prompt fed at once holds
    # every other session's step for its whole forward (on the H200, sessions with a 5 k-position prompt starting
    # together: stage0 queue waits 59-173 ms, first responses up to 4.6 s late, bench/RESULTS.md stop 37); in
    # chunks, the other sessions' tokens and units run between them, as vLLM's chunked prefill does. Any chunking
    # gives the same KV and logits as one forward (model.md I5; in bf16 up to the GEMMs' row-count rounding).
    prefix_chunk: int = 512
    # Decoded tokens first: a unit waits up to this many ms for its prefill (and its audio front end) while other
    # sessions have decoded tokens to feed, so those steps carry token rows only. A speaking session's text, and
    # with it the TTS and its first audio, is then not held behind other sessions' unit prefills (vLLM schedules
    # decodes before prefills the same way). The waiting units go together once the oldest is due, so they share
    # one front-end batch and one prefill step. A session's ids do not change (batch invariance, model.md I9);
    # only when its unit is decided. 0 = off: every ready row each step.
    prefill_hold_ms: int = 0
    # §9.5 benchmark-only: replace every sampled id by a script (all kernels still run). Rejected unless
    # `benchmark_mode` is set, which only benchmark entry points do.
    scripted_decisions: bool = False
    benchmark_mode: bool = False
    script_plan: ScriptPlan | None = None  # the cycle of a scripted session (None: ScriptPlan's defaults)

    def __post_init__(self) -> None:
        if (self.max_sessions < 1 or self.window_low > self.window_high or self.window_low < 1
                or self.span_align < 1):
            raise ValueError(f"bad Stage0Config: {self}")
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode {self.compile_mode!r}: use one of {COMPILE_MODES} or None")
        if self.prefill_attention not in ("auto", "gather", "flex"):
            raise ValueError(f"prefill_attention {self.prefill_attention!r}: use auto, gather or flex")
        if self.mixed_step not in ("split", "merge", "shared"):
            raise ValueError(f"mixed_step {self.mixed_step!r}: use split, merge or shared")
        if self.prefix_chunk < 0:
            raise ValueError(f"prefix_chunk {self.prefix_chunk}: use 0 (whole prefix) or a position count")
        if self.prefill_hold_ms < 0:
            raise ValueError(f"prefill_hold_ms {self.prefill_hold_ms}: use 0 (off) or a wait in ms")
        for name in ("flex_keys_per_split", "flex_prefill_keys_per_split", "flex_prefill_warps",
                     "flex_prefill_stages"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)}: use 0 (torch's choice) or a count")
        for name in ("gemm_min_rows", "gemm_tile_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)}: use 0 (off) or a row count")
        if self.decode_attention not in ("matmul", "sdpa", "flex"):
            raise ValueError(f"decode_attention {self.decode_attention!r}: use matmul, sdpa or flex")
        if self.scripted_decisions and not self.benchmark_mode:
            raise ValueError("scripted_decisions is benchmark-only (set benchmark_mode in a benchmark)")

    def prefill_lengths(self) -> tuple[int, ...]:
        """Positions of the common multi-token rows: a separate close, then a unit prefill with the previous
        close merged in front (an unmerged unit pads up to it), with 0..max frames."""
        close, unit = CLOSE_POSITIONS, 1 + self.audio_embeddings_per_unit
        frame = self.frame_embeddings + 2  # `<image>` + embeddings + `</image>`
        return (close, *(close + unit + k * frame for k in range(self.max_frames_per_unit + 1)))

    def unit_max_positions(self, rules: DecodeRules) -> int:
        """Upper bound of one unit's KV span: `<unit>` + frames + audio + A1 + fed tokens + close."""
        frames = self.max_frames_per_unit * (self.frame_embeddings + 2)
        return 1 + frames + self.audio_embeddings_per_unit + 1 + (rules.max_steps - 1) + 2

    def slot_len(self, rules: DecodeRules) -> int:
        """KV positions reserved per session: memory per session is bounded and known up front.

        One extra position (`SlotKVCache.reserved_pos`) absorbs the writes of idle rows in dense decode; the
        positions before it are rounded up to a multiple of `span_align`.
        """
        need = self.max_context if self.eviction == "off" else self.window_high + self.unit_max_positions(rules)
        return -(-need // self.span_align) * self.span_align + 1
