"""Multi-token rows attending straight over the slot KV: FlexAttention with a per-slot block mask (issue 16).

The gathered layout (`write_and_read_kv` with slot ids) copies every row's whole KV span in every layer before
attending; here the queries are scattered into a dense [slots + 1, heads, T, D] tensor instead (small: T is
a unit's dozen positions), and FlexAttention reads the cache tensors themselves. The block mask gives each
slot only the key blocks its queries reach: blocks wholly below the row's first position are "full" (no
mask evaluated), the blocks up to its last position are partial (`kv_idx <= position`), and a slot with no
row has no block at all, so an idle slot costs nothing and a row reads its own length, not the batch's
longest. Every tensor has a fixed size, so a CUDA graph can capture the step.

On CUDA the attention runs as the compiled (Triton) kernel: inside a compiled region as is, otherwise
through `torch.compile(flex_attention)`; elsewhere eager FlexAttention (a reference implementation that
materialises the scores: fine for tiny CPU models, not for a full-size one).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

KV_BLOCK = 128  # keys per block: FlexAttention's default sparse block size
Q_BLOCK = 128
# Longest rows left to the compiled flex *decoding* kernel (torch picks it below 128 queries; it packs the GQA
# group's heads x queries into one tile). Longer rows (a unit with camera frames, 79 / 145 positions) force the
# flex attention kernel: the decoding kernel found no valid configuration for 79-position rows on the H200
# (NoValidChoicesError, torch 2.11, stop 26).
FLEX_DECODING_MAX_POSITIONS = 16
# Keys per split of a row for the flex decoding kernel (its SPLIT_KV = the cache length / this). torch's default
# split count is 2 x SMs // (rows x kv heads), at least 1: 33 cache rows x 8 kv heads on 132 SMs got ONE split, so
# each program walked a slot's whole 8 k keys alone, latency-bound (26 of the 44 ms of 32 units' prefill at 8 k on
# the H200, stop 29). A split length fixed per engine, not a count from the batch, also keeps a row's sum order the
# same whatever rows share its step (batch invariance). The value is the H200 sweep's (bench/RESULTS.md, stop 29),
# which timed the attention kernel alone over a cache of the rows' own slots: the cost below did not show in it.
# Stage0's engine options `flex_keys_per_split` (flex decode rows) and `flex_prefill_keys_per_split` (unit prefills)
# override it per model (the `Qwen3LLM` attributes of those names); 0 gives torch's choice, which is fixed per
# engine too (for unit rows the kernel's batch is the cache's slot count; decode rows take that count explicitly).
KEYS_PER_SPLIT = 512
# What a split costs beside the kernel: every program writes its partial output in fp32, and a reduction reads them
# all back, for every row of the kernel's batch, which is the cache's slot count (33 for 32 sessions), not the live
# rows: `split_partials_bytes`. For a unit prefill (13 positions) at 17 splits that is 119 MB a layer, 8.6 GB written
# and read per forward (at least 1.8 ms at the H200's 4.8 TB/s) even with one live row; a decode row (1 position)
# pays a thirteenth of it. Hence separate split lengths for the two (Qwen3LLM.flex_prefill_keys_per_split).


class SlotBlocks(NamedTuple):
    """What every layer's flex attention shares in one forward."""

    block_mask: BlockMask
    slot_ids: torch.Tensor  # [B] the rows' slots (dummy rows: the scratch slot)
    split_kv: int | None = None  # the decoding kernel's splits of each row's keys (None: torch's choice)
    dense: bool = False  # single-token rows, row i = slot i: the kernel's batch is B (`dense_flex_decode`)
    tuning: tuple[tuple[str, int], ...] = ()  # the decoding kernel's num_warps / num_stages (`decode_tuning`)


def decode_tuning(warps: int, stages: int, device: torch.device) -> tuple[tuple[str, int], ...]:
    """The flex decoding kernel's Triton configuration beside its split (0: torch's). torch's default on sm_90 is
    one stage and two warps (torch/_inductor/template_heuristics/triton.py `get_flex_decode_configs`), sized for a
    decode row's few query rows per KV head; a unit packs its heads x positions (4 x 13 = 52) into each tile.
    Fixed per engine, so a row's numbers never follow its batch. Empty off CUDA (eager flex takes no options)."""
    if device.type != "cuda":
        return ()
    return tuple((k, v) for k, v in (("num_warps", warps), ("num_stages", stages)) if v > 0)


def decoding_options(split_kv: int | None, tuning: tuple[tuple[str, int], ...] = ()) -> dict[str, int]:
    """The flex decoding kernel's kernel_options: the Triton configuration (`decode_tuning`) and the split (None:
    torch's)."""
    return dict(tuning) | ({} if split_kv is None else {"SPLIT_KV": split_kv})


def decode_splits(max_len: int, device: torch.device, keys_per_split: int = KEYS_PER_SPLIT,
                  rows: int | None = None) -> int | None:
    """SPLIT_KV for the flex decoding kernel over cache rows of `max_len` positions: one split per `keys_per_split`
    keys. For 0, torch's choice: None, or with `rows` (kernel rows x kv heads) the count torch picks for that many
    rows (its `get_split_k`), fixed whatever the batch. None off CUDA (eager flex takes no kernel options)."""
    if device.type != "cuda":
        return None
    if keys_per_split == 0:
        return None if rows is None else max(1, torch.cuda.get_device_properties(device).multi_processor_count
                                              // rows * 2)
    return max(1, -(-max_len // keys_per_split))


def split_partials_bytes(slots: int, splits: int, heads: int, positions: int, head_dim: int) -> int:
    """Bytes of the partial outputs the flex decoding kernel writes (and its reduction reads) per layer: torch's
    buffer [slots, splits, heads, positions, head_dim] in fp32 (torch/_inductor/kernel/flex/flex_decoding.py)."""
    return slots * splits * heads * positions * head_dim * 4


def dense_blocks(write_pos: torch.Tensor, idle_pos: int, max_len: int, cache_rows: int,
                 keys_per_split: int = KEYS_PER_SPLIT) -> SlotBlocks:
    """Single-token rows of the dense layout (row i = slot i, write_pos [B, 1]): each row reads its own key blocks
    up to its position; an idle row (at `idle_pos`, output discarded) reads none. The kernel's batch is the rows'
    B over the cache's first B slots (a view, no copy), not every slot: at 8 k the kernel over all 33 slots of a
    32-session cache took 51 us a layer for one live row (H200, stop 48), most of it idle slots' programs and
    partials. B is a graph bucket, static where the kernel runs (`dense_flex_decode`). The split count never
    follows B (a row's sum order would follow its company): for keys_per_split 0 it is torch's count for the
    whole cache, `cache_rows` = cache slots x kv heads, as when the kernel ran over every slot."""
    b = write_pos.shape[0]
    pos = torch.where(write_pos == idle_pos, -1, write_pos)
    rows = torch.arange(b, device=write_pos.device)
    return slot_blocks(pos, torch.ones_like(pos, dtype=torch.bool), rows, b, max_len, keys_per_split,
                       cache_rows)._replace(dense=True)


def slot_blocks(write_pos: torch.Tensor, valid: torch.Tensor, slot_ids: torch.Tensor, slots: int,
                max_len: int, keys_per_split: int = KEYS_PER_SPLIT, split_rows: int | None = None,
                tuning: tuple[tuple[str, int], ...] = ()) -> SlotBlocks:
    """write_pos, valid [B, T]; slot_ids [B]; `slots` cache rows (the scratch slot included), `max_len`
    positions each. A padded query attends as its row's first query does (it is discarded). `split_rows`:
    `decode_splits`' rows for keys_per_split 0; `tuning`: `decode_tuning`'s options for the decoding kernel."""
    b, t = write_pos.shape
    device = write_pos.device
    qpos = torch.where(valid, write_pos, write_pos[:, :1])  # [B, T]
    q_blocks = -(-t // Q_BLOCK)
    kv_blocks = -(-max_len // KV_BLOCK)
    pad = q_blocks * Q_BLOCK - t
    dense = torch.full((slots, t), -1, dtype=torch.long, device=device)
    dense[slot_ids] = qpos  # a dummy row's slot (scratch) gets its position 0
    by_block = torch.nn.functional.pad(dense, (0, pad), value=-1).view(slots, q_blocks, Q_BLOCK)
    hi = by_block.amax(-1)  # [slots, QB] the block's last query position, -1 for none
    lo = torch.where(by_block < 0, max_len, by_block).amin(-1).clamp(max=max_len - 1)
    full = torch.where(hi < 0, 0, (lo + 1) // KV_BLOCK)  # key blocks wholly at or below every query
    partial = (hi // KV_BLOCK + 1 - full).clamp(min=0)
    j = torch.arange(kv_blocks, device=device, dtype=torch.int32)
    kv_indices = (full[..., None].to(torch.int32) + j).clamp(max=kv_blocks - 1)  # [slots, QB, KVB]
    full_indices = j.expand(slots, q_blocks, kv_blocks)
    mask_pos = dense  # the mask reads each query's position; -1 (no row) masks everything

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        del h
        return kv_idx <= mask_pos[bi, q_idx]

    mask = BlockMask.from_kv_blocks(
        partial[:, None].to(torch.int32), kv_indices[:, None].contiguous(),
        full[:, None].to(torch.int32), full_indices[:, None].contiguous(),
        BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, seq_lengths=(t, max_len), compute_q_blocks=False)
    return SlotBlocks(mask, slot_ids, decode_splits(max_len, device, keys_per_split, split_rows), tuning=tuning)


# Shapes one process compiles the standalone flex kernel for (batch bucket x length bucket x dtype x kernel options:
# dozens in a served stage0 without compiled layers). Past dynamo's default limit of 8 per code object every later
# shape would silently run the eager reference instead (materialised scores, other numerics).
FLEX_RECOMPILE_LIMIT = 256


@functools.cache
def _compiled_flex():  # noqa: ANN202 - torch.compile's wrapper type
    return torch.compile(flex_attention, dynamic=False)


def compiled_flex_attention(*args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003 - flex_attention's own
    """`torch.compile(flex_attention)` outside a compiled region, one static compile per shape, never the eager
    fallback that dynamo's recompile limit would otherwise choose after 8 shapes."""
    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        return _compiled_flex()(*args, **kwargs)


def flex_slot_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     blocks: SlotBlocks) -> torch.Tensor:
    """q [B, heads, T, D] → [B, heads, T, D], attending over one layer's caches [slots, kvh, max_len, D]."""
    if blocks.dense:
        return dense_flex_decode(q, k_cache, v_cache, blocks)
    _, heads, t, d = q.shape
    dense = q.new_zeros(k_cache.shape[0], heads, t, d)
    dense[blocks.slot_ids] = q
    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        fn = compiled_flex_attention
    if t > FLEX_DECODING_MAX_POSITIONS:
        options = {"FORCE_USE_FLEX_ATTENTION": True}
    else:
        options = decoding_options(blocks.split_kv, blocks.tuning) or None
    out = fn(dense, k_cache, v_cache, block_mask=blocks.block_mask, enable_gqa=heads != k_cache.shape[1],
             kernel_options=options)
    return out[blocks.slot_ids]  # type: ignore[index] - no return_lse


@torch.compiler.disable
def dense_flex_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      blocks: SlotBlocks) -> torch.Tensor:
    """Dense single-token rows q [B, heads, 1, D] over the caches' first B slots (`dense_blocks`). Outside the
    compiled decoder layer (a graph break), whose batch is symbolic: here B is a plain size, so the flex decoding
    kernel, which needs a static batch, is compiled for it as for any standalone call (`compiled_flex_attention`).
    An opaque custom op instead would run this under the compiled caller's dispatch state, where neither eager nor
    compiled flex can trace its mask (vmap and functionalization are excluded there)."""
    b, heads = q.shape[:2]
    fn = compiled_flex_attention if q.device.type == "cuda" else flex_attention
    options = decoding_options(blocks.split_kv) or None
    return fn(q, k_cache[:b], v_cache[:b], block_mask=blocks.block_mask, enable_gqa=heads != k_cache.shape[1],
              kernel_options=options)  # type: ignore[return-value] - no return_lse
