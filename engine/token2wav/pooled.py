"""One flow forward for a ragged batch of pooled sessions (§6.5 steps 1–4, issue 4).

Rows may differ in code count, `last`, prompt length and cache lengths. Per call:
  1. conformer: one gather of every slot's history in logical order, left-padded (ragged.py) → μ and
     the new K/V, written by one index_put straight into free positions of each slot
  2. estimator: per Euler step, each slot's physical window [0, Tg) of that step is gathered into a
     one-step batch tensor (the DiT has no positions, so frames stay where they are); the step scatters
     its new K/V into it, attends under a per-row key mask, and one index_put writes the step's new
     frames back into the slots (padded frames into column Tg − 1, which no slot uses). All of it runs
     inside the solve (graph), so the window buffer is one step, not n_ts steps, of the batch
  3. trims: index bookkeeping only (SlotState.append)
Noise per row is rand_noise[L_b : L_b + F_b] with L_b the row's own estimator length. Every index is
planned on the host first and moved in ONE transfer, so no pageable copy stalls the GPU stream midway.

With graphs the batch is padded to the solver's row bucket (buckets.py) by dummy rows: a fresh turn
of la + 1 zero codes (one new token frame, `stride` mel frames) with no history, so no key dimension
(N, F, C, Tg) grows. A dummy's gathers point at row 0's slot with every position masked (its only
estimator key is column Tg − 1, which it writes itself), and the only thing it writes back is that
unused column of row 0's slot, like row 0's own padded frames; every other write-back takes the real
rows only. Row-wise kernels keep a real row's result independent of the other rows (tested).

With graphs the widths are fixed too (`fixed`): the token input at one of two widths (a steady call's, a
last call's), the gathered histories and the estimator window at the pool's caps. A graph's key is then
its row bucket and token width only, so the warm-up turns build every graph a served turn meets; widths
that followed each turn's depth and history missed on the H200 and ran eager mid-load (stop 30).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.token2wav.assets import Token2WavModels
from engine.token2wav.call import FlowSession, PendingCall
from engine.token2wav.pool import FlowPool, SlotState
from engine.token2wav.ragged import round_up
from engine.token2wav.ragged_graphs import RaggedSolver


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """int64 host arrays → device tensors through one (pinned, async) copy."""
    flat = np.concatenate([a.astype(np.int64).ravel() for a in arrays.values()])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    out, at = {}, 0
    for name, a in arrays.items():
        out[name] = dev[at: at + a.size].view(a.shape)
        at += a.size
    return out


def _left_padded(orders: Sequence[np.ndarray], bucket: int, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Logical index arrays → (index [B, C] left-padded with 0, valid [B, C]); C = `width` if given."""
    width = width or round_up(max(o.shape[0] for o in orders), bucket)
    idx, valid = np.zeros((len(orders), width), np.int64), np.zeros((len(orders), width), bool)
    for b, o in enumerate(orders):
        if o.shape[0]:
            idx[b, width - o.shape[0]:], valid[b, width - o.shape[0]:] = o, True
    return idx, valid


def _rows_cols(pos: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row new positions → (batch row, position) pairs of every new frame."""
    return np.repeat(np.arange(len(pos)), [p.shape[0] for p in pos]), np.concatenate(pos)


def _token_width(pool: FlowPool, n_in: int, fixed: bool, widest: bool = False) -> int:
    """Token input columns: bucketed, or with `fixed` the smallest of a steady call's and a last call's width
    (with `widest` the last call's, whatever the rows need)."""
    width = round_up(n_in, pool.pcfg.token_bucket)
    if fixed:
        la, bucket = pool.fcfg.pre_lookahead_len, pool.pcfg.token_bucket
        widths = (round_up(pool.scfg.chunk_call, bucket), round_up(pool.scfg.chunk_call + la, bucket))
        width = min((w for w in widths[int(widest):] if w >= n_in), default=width)
    return width


def _plan(pool: FlowPool, slots: Sequence[SlotState], calls: Sequence[PendingCall], rows: int,
          fixed: bool = False, widest: bool = False) -> tuple[dict, dict]:
    """Index arrays of `rows` batch rows: the calls' rows, then `rows − len(calls)` dummy rows. `fixed`: the
    widths that do not depend on the rows' histories (module doc); `widest`: nor on the rows' calls."""
    fcfg, pc, n, pad = pool.fcfg, pool.pcfg, len(slots), rows - len(slots)
    la, stride = fcfg.pre_lookahead_len, fcfg.up_stride
    last = np.array([c.last for c in calls] + [False] * pad)
    m = np.array([len(c.tokens) for c in calls] + [la + 1] * pad)          # a dummy: one new token frame
    t_new = m - la * ~last
    frames = stride * t_new
    n_in = m + la * last                                                    # a last row gets 3 pad frames
    tokens = np.zeros((rows, _token_width(pool, int(n_in.max()), fixed, widest)), np.int64)
    for i, c in enumerate(calls):
        tokens[i, : m[i]] = c.tokens
    fm = stride * (tokens.shape[1] - la)
    tok_pos = [s.free_tok(int(t)) for s, t in zip(slots, t_new, strict=False)]
    mel_pos = [s.free_mel(int(f)) for s, f in zip(slots, frames, strict=False)]
    est_pos = [s.free_est(int(f)) for s, f in zip(slots, frames, strict=False)]
    empty = np.zeros(0, np.int64)
    used = max(int(max(s.est.max(initial=0), p.max(initial=0))) for s, p in zip(slots, est_pos, strict=True))
    tg = pool.est_width if fixed else min(round_up(used + 2, pc.cache_bucket), pool.est_width)   # tg − 1: trash column
    est_hist = [s.est for s in slots] + [empty] * pad
    est_rows = est_pos + [np.full(stride, tg - 1)] * pad                   # a dummy's only key: the trash column
    est_len = np.array([h.shape[0] for h in est_hist])
    if int((est_len + frames).max()) > fcfg.noise_frames:
        raise ValueError(f"flow noise exhausted ({fcfg.noise_frames} frames)")
    key_mask, wpos = np.zeros((rows, tg), bool), np.full((rows, fm), tg - 1, np.int64)
    for i, (h, p) in enumerate(zip(est_hist, est_rows, strict=True)):
        key_mask[i, h] = key_mask[i, p] = True
        wpos[i, : frames[i]] = p
    tok_idx, tok_valid = _left_padded([s.tok for s in slots] + [empty] * pad, pc.cache_bucket,
                                      pool.tok_width if fixed else 0)
    mel_idx, mel_valid = _left_padded([s.mel for s in slots] + [empty] * pad, pc.cache_bucket,
                                      pool.mel_width if fixed else 0)
    slot = np.array([s.slot for s in slots] + [slots[0].slot] * pad)        # dummies gather row 0's slot, masked
    (tr, tc), (mr, mc) = _rows_cols(tok_pos), _rows_cols(mel_pos)
    arrays = dict(slot=slot, m=m, t_new=t_new, frames=frames, tokens=tokens, key_mask=key_mask, wpos=wpos,
                  noise_at=np.minimum(est_len[:, None] + np.arange(fm)[None], fcfg.noise_frames - 1),
                  tok_idx=tok_idx, tok_valid=tok_valid, mel_idx=mel_idx, mel_valid=mel_valid,
                  tok_row=tr, tok_col=tc, tok_slot=slot[tr], mel_row=mr, mel_col=mc, mel_slot=slot[mr],
                  tok_f=np.concatenate([np.arange(t) for t in t_new[:n]]),   # frame of each new K/V in its row
                  mel_f=np.concatenate([np.arange(f) for f in frames[:n]]))
    return arrays, {"frames": frames, "pos": (est_pos, tok_pos, mel_pos)}


@torch.inference_mode()
def run_flow_pooled(models: Token2WavModels, pool: FlowPool, sessions: Sequence[FlowSession],
                    calls: Sequence[PendingCall], solver: RaggedSolver | None = None, tile: int = 0) -> None:
    """Flow phase + trims for any mix of pooled sessions; sets `call.mel` [1, 80, F_b] per row.
    `solver`: CUDA-graph runner of the estimator solve (ragged_graphs.py); None = eager. `tile` K: the batch
    on exactly K rows (at most K sessions) at fixed and widest widths, with or without graphs, so every kernel
    sees the same shapes whatever shares the batch (Token2WavEngineConfig.tile_rows)."""
    flow, fcfg = models.flow, models.flow_cfg
    slots = [s.slot for s in sessions]
    assert all(s is not None and s.pool is pool for s in slots), "run_flow_pooled: session without a slot"
    assert len({s.slot for s in slots}) == len(slots), "run_flow_pooled: one call per session per batch"   # type: ignore[union-attr]
    solver = solver or RaggedSolver(flow.decoder.estimator, enabled=False)
    n, b = len(slots), tile or solver.rows(len(slots))                     # real rows, batch rows (bucket)
    assert n <= b, f"run_flow_pooled: {n} rows over the tile of {tile}"
    arrays, host = _plan(pool, slots, calls, b, fixed=solver.enabled or bool(tile), widest=bool(tile))  # type: ignore[arg-type]
    d = to_device(arrays, pool.device)
    n_ts = pool.scfg.n_timesteps

    # 1. conformer: [S, L, H, T, 2dk][slot, :, :, idx] → [B, C, L, H, 2dk] → [L, B, H, C, 2dk]
    hist = lambda t, idx: t[d["slot"][:, None], :, :, idx].permute(2, 0, 3, 1, 4)  # noqa: E731
    mu, enc_cnn, new_tok, new_mel = solver.encode(
        flow, d["tokens"], d["m"], d["t_new"], pool.enc_cnn.index_select(0, d["slot"]),
        hist(pool.tok_att, d["tok_idx"]), d["tok_valid"].bool(), hist(pool.mel_att, d["mel_idx"]),
        d["mel_valid"].bool())
    pool.enc_cnn.index_copy_(0, d["slot"][:n], enc_cnn[:n])               # real rows only (a dummy shares row 0's slot)
    # new K/V [L, B, H, F, 2dk] → per new frame [N, L, H, 2dk] → pool[slot, :, :, position]
    pool.tok_att[d["tok_slot"], :, :, d["tok_col"]] = new_tok[:, d["tok_row"], :, d["tok_f"]]
    pool.mel_att[d["mel_slot"], :, :, d["mel_col"]] = new_mel[:, d["mel_row"], :, d["mel_f"]]

    # 2. estimator over each slot's physical window [0, tg), read and written in place (one step at a time)
    k1 = fcfg.dit_conv_kernel - 1
    cnn_end = d["frames"][:, None] + torch.arange(k1, device=pool.device)[None]   # [B, k − 1]
    est_cnn = pool.est_cnn.index_select(0, d["slot"]).permute(1, 2, 3, 0, 4, 5)   # [n_ts, depth, 2, B, 2C, k − 1]
    noise = flow.decoder.rand_noise[0][:, d["noise_at"]].transpose(0, 1).contiguous()   # [B, 80, F]
    two = lambda x: torch.cat([x, x], dim=0)  # noqa: E731  (cond rows, then uncond rows)
    spk = [s.voice.spk_proj for s in sessions]
    mel, new_cnn = solver.solve(
        noise, mu, torch.cat(spk + [spk[0].new_zeros(b - n, spk[0].shape[1])], dim=0),
        n_ts, fcfg.cfg_rate, est_cnn.reshape(n_ts, fcfg.dit_depth, 2 * b, *est_cnn.shape[4:]),
        pool.est_att, two(d["key_mask"].bool()), two(d["wpos"]), two(cnn_end), d["slot"])
    pool.est_cnn.index_copy_(0, d["slot"][:n], new_cnn.view(n_ts, fcfg.dit_depth, 2, b, *new_cnn.shape[3:])
                             [:, :, :, :n].permute(3, 0, 1, 2, 4, 5))

    # 3. trims (bookkeeping) and per-row outputs
    est_pos, tok_pos, mel_pos = host["pos"]
    for i, (s, c) in enumerate(zip(slots, calls, strict=True)):
        s.append(est_pos[i], tok_pos[i], mel_pos[i])   # type: ignore[union-attr]
        c.mel = mel[i: i + 1, :, : host["frames"][i]].clone()
