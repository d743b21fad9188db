"""Row buckets of the batched Token2Wav graphs (the ragged flow batch and the HiFT batches).

A CUDA graph is captured per shape, and the row count was the one key dimension that took every value
1..max_batch (32 sizes × ~11 graphs at 32 sessions: 352 graphs, 99 s of warm-up, GBs of static buffers).
A batch of n rows now runs at the smallest bucket >= n; the extra rows are dummies whose results are
dropped and whose writes never reach a session's state (pooled.py, Token2WavEngine._run_hift).

The buckets: powers of two up to 16, then every 8 up to 32, then every 16, and max_batch itself:
  max_batch 32 → 1 2 4 8 16 24 32 (7)     max_batch 64 → 1 2 4 8 16 24 32 48 64 (9)
Below 16 rows the DiT solve is bound by launches and weight reads, not by rows (22 ms at batch 1 against
82 ms at batch 32 on the H200, docs/deploy.md), so a padded row there costs little and doubling is
enough; above 16 the cost grows with the rows, so the steps are finer: at most 7 padded rows of 24
(29 %) up to 32, at most 15 of 48 (31 %) above. A dummy row costs its share of the solve's arithmetic
and of the K/V window gather; it writes no session's state back (pooled.py).
"""

from __future__ import annotations

import bisect

SMALL = 16     # doubling up to here
STEP_MID = 8   # then this step up to MID
MID = 32
STEP_BIG = 16  # then this step


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Every row count a batch of 1..`max_rows` rows is padded to, ascending; `max_rows` is the last."""
    if max_rows < 1:
        raise ValueError(f"row_buckets: max_rows must be >= 1, got {max_rows}")
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b = 2 * b if b < SMALL else b + (STEP_MID if b < MID else STEP_BIG)
    return (*out, max_rows)


def bucket_rows(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; n itself beyond the largest (never with buckets from `row_buckets`)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n
