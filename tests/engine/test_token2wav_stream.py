"""Streaming Token2Wav: reference-stream parity, §6.6 sample counts, trims, isolation (I8, I14)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.token2wav.assets import TINY_HIFT, Token2WavModels, build_tiny_modules
from engine.token2wav.config import TINY_FLOW, StreamConfig
from engine.token2wav.stream import PendingCall, StreamInputError, new_session, run_flow_batch
from engine.token2wav.voice import VoiceError, VoicePack, build_voice_cache
from tests.engine.test_token2wav_refutil import RefStreamer, build_ref_flow, build_ref_hift, enlarge_flow_

N_TS = 2


def make_voice(seed: int, p_tok: int = 8) -> VoicePack:
    g = torch.Generator().manual_seed(seed)
    return VoicePack(prompt_tokens=torch.randint(0, TINY_FLOW.vocab_size, (p_tok,), generator=g, dtype=torch.int32),
                     spk_embedding=torch.randn(192, generator=g),
                     prompt_mel=torch.randn(2 * p_tok, 80, generator=g),
                     ref_audio_16k=torch.randn(16000, generator=g) * 0.1)


@pytest.fixture(scope="module")
def models() -> Token2WavModels:
    flow, hift = build_tiny_modules(seed=0)
    enlarge_flow_(flow)
    with torch.no_grad():   # louder than the §9.4 init so PCM samples are not all zero
        hift.conv_post.bias.fill_(1.0)
        hift.f0_predictor.classifier.bias.fill_(30.0)
    return Token2WavModels(flow.eval(), hift.eval(), TINY_FLOW, TINY_HIFT, "A")


def codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, TINY_FLOW.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_turn(session, units):
    outs = []
    for i, u in enumerate(units):
        outs.append(session.synthesize_unit(u, end_of_turn=i == len(units) - 1))
    return outs


@pytest.mark.parametrize("p_tok", [8, 60])
def test_stream_matches_reference_port(models, p_tok):
    scfg = StreamConfig(n_timesteps=N_TS)
    voice = make_voice(1, p_tok)
    vc = build_voice_cache(models.flow, voice, scfg)
    ses = new_session(models, vc, scfg, seed=5)
    ref = RefStreamer(build_ref_flow(models.flow), build_ref_hift(models.hift), voice.prompt_tokens,
                      voice.prompt_mel, voice.spk_embedding, N_TS, scfg.silence_code)
    units = [codes(10 + i, 25) for i in range(5)] + [codes(99, 12)]
    torch.manual_seed(5)   # the reference HiFT draws from the global RNG; ours from the session generator
    for i, u in enumerate(units):
        plan = ses.plan_unit(u, end_of_turn=i == len(units) - 1)
        for c in plan.calls:
            ours = ses.stream(c.tokens, c.last)
            theirs = ref.stream(c.tokens, c.last)
            assert ours.shape == theirs.shape
            assert np.abs(ours.astype(np.int32) - theirs).max() <= 1
            assert np.abs(ours).max() > 100
        assert ses.flow_cache.estimator_att.shape == ref.cache["estimator_att_cache"][:N_TS].shape
        torch.testing.assert_close(ses.flow_cache.conformer_att, ref.cache["conformer_att_cache"], atol=1e-5, rtol=1e-4)


def test_worked_example_sample_counts(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    ses = new_session(models, build_voice_cache(models.flow, make_voice(2), scfg), scfg, seed=0)
    units = [codes(1, 25), codes(2, 25), codes(3, 12)]
    plans = []
    for i, u in enumerate(units):
        eot = i == 2
        plan = ses.plan_unit(u, eot)
        pcm = np.concatenate([ses.stream(c.tokens, c.last) for c in plan.calls])
        assert pcm.shape[0] == plan.samples and plan.pad == 0
        plans.append(([len(c.tokens) for c in plan.calls], pcm.shape[0]))
        if i == 0:
            assert not pcm[:3840].any() and pcm[3840:].any()     # 160 ms lead-in of zeros
    assert plans == [([28], 24000), ([28], 24000), ([15, 3], 18240)]


def test_unit_rules_padding_and_silence(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    ses = new_session(models, build_voice_cache(models.flow, make_voice(2), scfg), scfg, seed=0)
    assert ses.synthesize_unit(codes(1, 4), False).shape == (24000,)         # < 8 buffered: silence
    assert not ses.synthesize_unit([], False).any()
    short = ses.synthesize_unit(codes(2, 6), False)                         # 13 buffered → stream(13)
    assert short.shape == (24000,) and not short[:24000 - 20 * 480].any()   # left-padded
    ses2 = new_session(models, ses.voice, StreamConfig(n_timesteps=N_TS, force_flush="turn_start"), seed=0)
    ses2.synthesize_unit(codes(1, 25), False)
    assert ses2.plan_unit(codes(2, 10), False).calls == []                       # mid-turn: wait for 28


def test_trim_options(models):
    voice = make_voice(3, 60)
    out = {}
    for ft in ("reference", "prompt_plus_recent"):
        for ct in ("v0.1.2", "v1.0.7"):
            scfg = StreamConfig(n_timesteps=N_TS, flow_cache_trim=ft, conformer_cache_trim=ct)
            vc = build_voice_cache(models.flow, voice, scfg)
            ses = new_session(models, vc, scfg, seed=0)
            for i in range(4):
                ses.synthesize_unit(codes(i, 25), False)
            p = vc.prompt_frames
            est, att = ses.flow_cache.estimator_att, ses.flow_cache.conformer_att
            assert est.shape[4] == p + 100 and att.shape[3] == p + 100
            if ft == "prompt_plus_recent":   # storage is [newest …, prompt]: the prompt stays whole
                torch.testing.assert_close(est[..., -p:, :], vc.flow.estimator_att)
            if ct == "v1.0.7":               # token-rate layers stay tiled ×2
                n_tok, half = TINY_FLOW.enc_blocks, att.shape[3] // 2
                torch.testing.assert_close(att[:n_tok, :, :, :half], att[:n_tok, :, :, half:])
            call = PendingCall(ses.buffer + codes(9, 25), False)
            run_flow_batch(models, [ses], [call])
            out[(ft, ct)] = call.mel
    ref = out[("reference", "v0.1.2")]
    assert (ref - out[("prompt_plus_recent", "v0.1.2")]).abs().max() > 1e-5
    assert (ref - out[("reference", "v1.0.7")]).abs().max() > 1e-5


def _ranges(tensors):
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in tensors if t.numel()]


def test_sessions_isolated_and_base_cache_untouched(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    va = build_voice_cache(models.flow, make_voice(4), scfg)
    vb = build_voice_cache(models.flow, make_voice(5, 12), scfg)
    base_before = [t.clone() for t in va.tensors()]
    units = [codes(20 + i, 25) for i in range(4)] + [codes(30, 7)]
    alone = run_turn(new_session(models, va, scfg, seed=1), units)
    a, b = new_session(models, va, scfg, seed=1), new_session(models, vb, scfg, seed=2)
    mixed = []
    for i, u in enumerate(units):
        b.synthesize_unit(codes(40 + i, 25), False)
        mixed.append(a.synthesize_unit(u, end_of_turn=i == len(units) - 1))
        b.synthesize_unit(codes(50 + i, 3), False)
        ra, rb = _ranges(a.owned_tensors()), _ranges(b.owned_tensors()) + _ranges(va.tensors())
        assert not any(x0 < y1 and y0 < x1 for x0, x1 in ra for y0, y1 in rb)
    for x, y in zip(alone, mixed, strict=True):
        np.testing.assert_array_equal(x, y)
    # second turn of A starts from the untouched base cache
    again = run_turn(a, units)
    for x, y in zip(alone[1:], again[1:], strict=True):
        assert x.shape == y.shape
    for t0, t1 in zip(base_before, va.tensors(), strict=True):
        assert torch.equal(t0, t1)
    a.reset_turn()   # I14: a reset restores the base cache, as an owned copy
    for t0, t1 in zip(a.flow_cache.tensors(), va.flow.tensors(), strict=True):
        assert torch.equal(t0, t1) and t0.untyped_storage().data_ptr() != t1.untyped_storage().data_ptr()


def test_seeded_determinism(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    vc = build_voice_cache(models.flow, make_voice(6), scfg)
    units = [codes(1, 25), codes(2, 25)]
    one = run_turn(new_session(models, vc, scfg, seed=3), units)
    two = run_turn(new_session(models, vc, scfg, seed=3), units)
    other = run_turn(new_session(models, vc, scfg, seed=4), units)
    assert all(np.array_equal(x, y) for x, y in zip(one, two, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(one, other, strict=True))


def test_bad_inputs(models):
    scfg = StreamConfig(n_timesteps=N_TS)
    vc = build_voice_cache(models.flow, make_voice(7), scfg)
    ses = new_session(models, vc, scfg, seed=0)
    with pytest.raises(StreamInputError):
        ses.synthesize_unit([TINY_FLOW.vocab_size], False)
    with pytest.raises(StreamInputError):
        ses.stream([1, 2, 3], last=False)
    bad = make_voice(8)
    with pytest.raises(VoiceError):
        build_voice_cache(models.flow, VoicePack(bad.prompt_tokens, bad.spk_embedding, bad.prompt_mel[:-1]), scfg)
    with pytest.raises(VoiceError):
        build_voice_cache(models.flow, {"prompt_tokens": bad.prompt_tokens}, scfg)
