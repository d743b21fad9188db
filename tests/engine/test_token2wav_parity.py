"""Parity of our Flow encoder, DiT estimator and CFM solve with the Step-Audio2 reference (tiny, fp32)."""

from __future__ import annotations

import torch

from engine.token2wav.assets import build_tiny_modules
from engine.token2wav.flow import FlowCache
from tests.engine.test_token2wav_refutil import build_ref_flow, enlarge_flow_

ATOL = 1e-5


def _setup():
    flow, _ = build_tiny_modules(seed=3)
    enlarge_flow_(flow.eval())
    return flow, build_ref_flow(flow)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


def test_encoder_chunks_match_reference():
    flow, ref = _setup()
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 6561, (1, 70), generator=g)
    ours_cnn = ours_att = ref_cnn = ref_att = None
    with torch.inference_mode():
        for lo, hi, last in ((0, 19, False), (16, 44, False), (41, 60, False), (57, 70, True)):
            x = flow.input_embedding(toks[:, lo:hi])
            h, ours_cnn, ours_att = flow.encoder.forward_chunk(x, last, ours_cnn, ours_att)
            h_ref, ref_cnn, ref_att = ref.encoder.forward_chunk(x, last, ref_cnn, ref_att)
            _close(h, h_ref)
            _close(ours_cnn, ref_cnn)
            _close(ours_att, ref_att)
            assert h.shape[1] == 2 * (hi - lo - (0 if last else 3))


def test_dit_chunk_matches_reference():
    flow, ref = _setup()
    g = torch.Generator().manual_seed(2)
    c = flow.cfg
    x, mu, cond = (torch.randn(2, 80, 12, generator=g) for _ in range(3))
    t, spk = torch.rand(2, generator=g), torch.randn(2, 80, generator=g)
    cnn = torch.randn(c.dit_depth, 2, 2 * c.dit_hidden, 2, generator=g)
    att = torch.randn(c.dit_depth, 2, c.dit_heads, 7, 2 * c.dit_head_dim, generator=g)
    with torch.inference_mode():
        v, ncnn, natt = flow.decoder.estimator.forward_chunk(x, mu, t, spk, cond, cnn, att)
        rv, rcnn, ratt = ref.decoder.estimator.forward_chunk(x, mu, t, spk, cond, cnn, att)
        _close(v, rv)
        _close(ncnn, rcnn)
        _close(natt, ratt)
        v0, _, natt0 = flow.decoder.estimator.forward_chunk(x, mu, t, spk, cond, None, None)
        rv0, _, ratt0 = ref.decoder.estimator.forward_chunk(x, mu, t, spk, cond, None, None)
        _close(v0, rv0)
        _close(natt0, ratt0)


def test_setup_and_chunks_match_reference():
    flow, ref = _setup()
    g = torch.Generator().manual_seed(4)
    n_ts, p_tok = 3, 8
    prompt = torch.randint(0, 6561, (1, p_tok + 3), generator=g)
    mel = torch.randn(1, 2 * p_tok, 80, generator=g)
    spk = torch.randn(1, 192, generator=g)
    ours = flow.setup_cache(prompt, mel, spk, n_ts)
    theirs = ref.setup_cache(prompt, mel, spk, n_timesteps=n_ts)
    _close(ours.conformer_cnn, theirs["conformer_cnn_cache"])
    _close(ours.conformer_att, theirs["conformer_att_cache"])
    _close(ours.estimator_cnn, theirs["estimator_cnn_cache"][:n_ts])
    _close(ours.estimator_att, theirs["estimator_att_cache"][:n_ts])
    theirs = {k: v.clone() for k, v in theirs.items()}
    spk_proj = flow.project_spk(spk)
    for m, last in ((28, False), (20, False), (5, True)):
        toks = torch.randint(0, 6561, (1, m), generator=g)
        mel_o, ours = flow.forward_chunk(toks, spk_proj, ours, last, n_ts)
        mel_r, theirs = ref.inference_chunk(toks, spk, theirs, last, n_ts)
        theirs = {k: v.clone() for k, v in theirs.items()}
        _close(mel_o, mel_r)
        assert isinstance(ours, FlowCache)
        _close(ours.estimator_att, theirs["estimator_att_cache"][:n_ts])
        _close(ours.conformer_att, theirs["conformer_att_cache"])
        assert mel_o.shape[2] == 2 * (m if last else m - 3)


def test_dit_streaming_equals_offline_block_causal():
    """Chunked DiT with caches == one offline pass whose mask lets each chunk see itself and the past.

    The DiT has no positional encoding, so the cache's newest-first storage order does not matter;
    the causal convs carry 2 frames of history across chunks.
    """
    flow, _ = _setup()
    dit = flow.decoder.estimator
    g = torch.Generator().manual_seed(9)
    sizes = [16, 50, 50, 6]
    total = sum(sizes)
    x, mu, cond = (torch.randn(2, 80, total, generator=g) for _ in range(3))
    t, spk = torch.rand(2, generator=g), torch.randn(2, 80, generator=g)
    block = torch.zeros(total, total, dtype=torch.bool)
    lo = 0
    for n in sizes:
        block[lo:lo + n, :lo + n] = True
        lo += n
    with torch.inference_mode():
        offline, _, _ = dit.forward_chunk(x, mu, t, spk, cond, None, None, block.expand(2, -1, -1))
        cnn = att = None
        outs, lo = [], 0
        for n in sizes:
            sl = slice(lo, lo + n)
            v, cnn, att = dit.forward_chunk(x[..., sl], mu[..., sl], t, spk, cond[..., sl], cnn, att)
            outs.append(v)
            lo += n
    _close(torch.cat(outs, dim=2), offline, atol=2e-5)
