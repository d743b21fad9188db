"""Ragged conformer encoder: rows with different code counts, `last` flags and cache lengths (§6.5 step 1).

Layout of a ragged batch (B rows, row b has m_b codes, t_b = m_b − 3 token frames, or m_b if last):
  tokens   [B, N]            right-padded (N ≥ m_b + 3); padding frames are zeroed after the input layer,
                             which is exactly the 3-frame look-ahead pad of a `last` row
  history  [L, B, H, C, 2dk] LEFT-padded (valid frames end at C), new frames right-padded after it, so
                             key j and query i of every row sit at distance C + i − j as in the solo call
                             and one shared relative-position table serves the whole batch
  masks    [B, C]            True = a real history frame; padded keys get −inf before the softmax
Causal-conv histories are taken per row at each row's own end. Only the new K/V come back (the
caller writes them into each session's pool slot, pool.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.token2wav.flow import Flow


def round_up(n: int, bucket: int) -> int:
    return max(bucket, -(-n // bucket) * bucket)


def tail_index(end: torch.Tensor, width: int, channels: int) -> torch.Tensor:
    """[B] per-row end → gather index [B, channels, width] for frames end … end + width − 1."""
    idx = end[:, None] + torch.arange(width, device=end.device)[None]
    return idx[:, None, :].expand(-1, channels, -1)


def valid_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B] lengths → [B, width] bool, True for the first `length` frames."""
    return torch.arange(width, device=lengths.device)[None] < lengths[:, None]


def encode_ragged(flow: Flow, tokens: torch.Tensor, m: torch.Tensor, t_new: torch.Tensor, cnn: torch.Tensor, tok_kv: torch.Tensor, tok_mask: torch.Tensor, mel_kv: torch.Tensor,
                  mel_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, N]; m [B] codes per row; t_new [B] token frames per row (m − 3, or m if last); cnn [B, D, 6]; tok_kv [Lt, B, H, Hc, 2dk] / tok_mask [B, Hc]; mel_kv [Lm, B, H, Tc, 2dk]
    / mel_mask [B, Tc] → (μ [B, 80, 2·Tq], new cnn [B, D, 6], new token K/V [Lt, B, H, Tq, 2dk],
    new mel K/V [Lm, B, H, 2·Tq, 2dk]) with Tq = N − 3; row b's valid part is its first t_b (2·t_b) frames."""
    enc, cfg = flow.encoder, flow.cfg
    la, k2, stride = cfg.pre_lookahead_len, cfg.pre_lookahead_conv2_kernel - 1, cfg.up_stride
    n = tokens.shape[1]
    xs = enc.embed(flow.input_embedding(tokens))                                      # [B, N, D]
    xs = xs.masked_fill(~valid_mask(m, n)[..., None], 0.0)                            # look-ahead zeros
    # pre-lookahead layer: conv1 reads frames i … i + 3, so a row's valid outputs never see its padding
    pl = enc.pre_lookahead_layer
    h = F.leaky_relu(pl.conv1(xs.transpose(1, 2)), pl.slope)                          # [B, D, Tq]
    hc = torch.cat([cnn[:, :, :k2], h], dim=2)
    new_cnn1 = hc.gather(2, tail_index(t_new, k2, hc.shape[1]))                       # last k2 valid frames
    xs = xs[:, :-la] + pl.conv2(hc).transpose(1, 2)  # [B, Tq, D]; the row-major operand first: a row-major sum
    tq = n - la
    hist = tok_kv.shape[3]
    mask = torch.cat([tok_mask, valid_mask(t_new, tq)], dim=1)                        # [B, Hc + Tq]
    pos = enc._pos(hist + tq)
    new_tok = []
    for i, layer in enumerate(enc.encoders):
        xs, c = enc.block_fn(layer, xs, pos, tok_kv[i] if hist else None, mask)
        new_tok.append(c[:, :, hist:])
    # upsample: repeat ×stride, causal conv with 2·stride frames of history per row
    up = torch.cat([cnn[:, :, k2:], xs.transpose(1, 2).repeat_interleave(stride, dim=2)], dim=2)
    new_cnn2 = up.gather(2, tail_index(stride * t_new, cnn.shape[2] - k2, up.shape[1]))
    xs = enc.up_embed(enc.up_layer.conv(up).transpose(1, 2))                          # [B, 2·Tq, D]
    hist = mel_kv.shape[3]
    mask = torch.cat([mel_mask, valid_mask(stride * t_new, stride * tq)], dim=1)
    pos = enc._pos(hist + stride * tq)
    new_mel = []
    for i, layer in enumerate(enc.up_encoders):
        xs, c = enc.block_fn(layer, xs, pos, mel_kv[i] if hist else None, mask)
        new_mel.append(c[:, :, hist:])
    mu = flow.encoder_proj(enc.after_norm(xs)).transpose(1, 2).contiguous()          # [B, 80, 2·Tq]
    return mu, torch.cat([new_cnn1, new_cnn2], dim=2), torch.stack(new_tok), torch.stack(new_mel)
