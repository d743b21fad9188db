"""Input decoding, resampling and unit framing (protocol.md §8.6 U-1, §9) against offline references."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import soxr

from gateway.audio.codec import decode_audio, encode_output, rms
from gateway.audio.resample import InputResampler
from gateway.protocol.errors import ProtocolError
from gateway.session.units import UnitCutter, UnitGeometry


def _signal(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.1).astype(np.float32)


@pytest.mark.parametrize("chunk", [160, 3200, 7777])
def test_cutting_is_independent_of_chunking(chunk: int) -> None:
    x = _signal(16480 + 16000 * 2 + 1234)
    cutter = UnitCutter(UnitGeometry())
    units = []
    for i in range(0, len(x), chunk):
        units += cutter.push(x[i:i + chunk], now=0.0)
    assert [u.index for u in units] == [0, 1, 2]
    assert [len(u.samples) for u in units] == [16480, 16000, 16000]
    np.testing.assert_array_equal(np.concatenate([u.samples for u in units]), x[:48480])
    assert cutter.residual == 1234
    padded = cutter.pad(allow_empty=False)
    assert padded is not None and len(padded.samples) == 16000 and padded.client_samples == 1234
    np.testing.assert_array_equal(padded.samples[1234:], 0.0)


def test_unit_deadlines_sit_on_a_fixed_grid() -> None:
    cutter = UnitCutter(UnitGeometry(deadline_grace_s=0.0))
    cutter.push(np.zeros(3200, np.float32), now=10.2)  # 200 ms chunk received at t=10.2: anchor 10.0
    assert cutter.deadline() == pytest.approx(11.03)
    cutter.push(np.zeros(16000, np.float32), now=11.2)
    assert cutter.deadline() == pytest.approx(12.03)  # unit 1 ends at 2030 ms on the model clock
    cutter.reanchor_if_late(now=20.0)  # late: restart the grid so the partial unit fills in real time
    assert cutter.deadline() == pytest.approx(20.0 + (16000 - 2720) / 16000)


def test_stateful_resampler_matches_offline_soxr() -> None:
    x = _signal(24000 * 2, seed=1)
    r = InputResampler()
    parts = [r.process(x[i:i + 4800], 24000, "pcm16") for i in range(0, len(x), 4800)]
    parts.append(r.flush())
    streamed = np.concatenate(parts)
    offline = soxr.resample(x, 24000, 16000, quality="HQ")
    assert len(streamed) == len(offline) == 32000
    np.testing.assert_allclose(streamed, offline, atol=1e-5)


def test_decode_formats() -> None:
    pcm = (np.arange(-100, 100, dtype=np.int16) * 100).astype("<i2")
    d = decode_audio(pcm.tobytes(), "pcm16", 16000, rate_given=True)
    np.testing.assert_allclose(d.samples, pcm / 32768.0)
    f32 = np.array([0.5, -2.0, 2.0], dtype="<f4")
    np.testing.assert_allclose(decode_audio(f32.tobytes(), "pcm_f32le", 8000, rate_given=True).samples,
                               [0.5, -1.0, 1.0])  # clipped to [-1, 1]
    buf = io.BytesIO()
    soundfile.write(buf, pcm, 22050, format="WAV", subtype="PCM_16")
    w = decode_audio(buf.getvalue(), "wav", None, rate_given=False)
    assert w.rate_hz == 22050 and len(w.samples) == 200
    ulaw = io.BytesIO()
    soundfile.write(ulaw, pcm / 32768.0, 8000, format="RAW", subtype="ULAW")
    u = decode_audio(ulaw.getvalue(), "g711_ulaw", 8000, rate_given=False)
    np.testing.assert_allclose(u.samples, pcm / 32768.0, atol=0.02)
    with pytest.raises(ProtocolError) as exc:
        decode_audio(b"\x00" * 10, "g711_alaw", 16000, rate_given=True)
    assert exc.value.code == "bad_audio"


def test_pcm16_decodes_to_its_exact_scaled_values_in_range() -> None:
    pcm = np.array([-32768, -1, 0, 1, 12345, 32767], dtype="<i2")
    d = decode_audio(pcm.tobytes(), "pcm16", 16000, rate_given=False)
    assert d.samples.dtype == np.float32 and d.samples.flags.writeable
    np.testing.assert_array_equal(d.samples, pcm.astype(np.float32) / np.float32(32768.0))  # bit for bit
    assert d.samples.min() >= -1.0 and d.samples.max() < 1.0


def test_rms_is_the_root_mean_square() -> None:
    x = np.random.default_rng(0).standard_normal(1600).astype(np.float32) * 0.1
    assert rms(x) == pytest.approx(float(np.sqrt(np.mean(x.astype(np.float64) ** 2))), rel=1e-5)
    assert rms(np.zeros(0, np.float32)) == 0.0 and rms(np.full(4, 0.5, np.float32)) == 0.5


def test_encode_output_formats() -> None:
    pcm = (np.sin(np.arange(24000) * 0.01) * 10000).astype("<i2").tobytes()
    assert encode_output(pcm, "pcm16") == (pcm, 24000)
    f32, rate = encode_output(pcm, "pcm_f32le")
    assert rate == 24000 and len(f32) == 96000
    wav, _ = encode_output(pcm, "wav")
    data, sr = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert sr == 24000 and np.array_equal(data, np.frombuffer(pcm, "<i2"))
    mu, rate = encode_output(pcm, "g711_ulaw")
    assert rate == 8000 and len(mu) == 8000


def test_a_commit_puts_the_next_unit_on_the_shared_tick() -> None:
    """align_period_s: the unit after a commit ends on the next multiple of the period; a chunk that reaches past
    the tick is split there (its audio before the tick, then silence, closes the short unit) and the units after
    it follow one second apart from the tick, whatever phase the session's audio had."""
    cutter = UnitCutter(UnitGeometry(deadline_grace_s=0.0, align_period_s=1.0))
    x = _signal(16480 + 5000, seed=3)
    assert [u.index for u in cutter.push(x, now=7.33)] == [0]
    committed = cutter.pad(allow_empty=False)  # the commit's own unit, cut at 7.33
    assert committed is not None and committed.client_samples == 5000
    cutter.arm_tick(7.33)
    y = _signal(16000 * 2, seed=4)
    assert cutter.push(y[:4000], now=7.58) == []  # 250 ms before the tick at 8.0
    units = cutter.push(y[4000:12000], now=8.08)  # 500 ms chunk that passes the tick by 80 ms
    assert [u.index for u in units] == [2]
    short = units[0]
    assert short.client_samples == 4000 + 8000 - 1280  # the audio up to the tick
    np.testing.assert_array_equal(short.samples[:10720], y[:10720])
    np.testing.assert_array_equal(short.samples[10720:], 0.0)
    assert cutter.residual == 1280  # the 80 ms after the tick start unit 3
    assert cutter.deadline() == pytest.approx(9.0)  # unit 3 ends one second after the tick
    assert [u.index for u in cutter.push(y[12000:12000 + 14720], now=9.0)] == [3]
    assert cutter.cut_if_tick(9.5) == []  # not armed again until the next commit


def test_a_tick_with_no_audio_past_it_cuts_the_partial_unit_and_no_alignment_when_off() -> None:
    cutter = UnitCutter(UnitGeometry(deadline_grace_s=0.0, align_period_s=0.5))
    cutter.push(_signal(16480), now=3.1)
    cutter.arm_tick(3.1)  # the tick at 3.5
    cutter.push(_signal(1600), now=3.2)
    assert cutter.cut_if_tick(3.45) == []
    (short,) = cutter.cut_if_tick(3.52)
    assert short.index == 1 and short.client_samples == 1600 and len(short.samples) == 16000
    assert cutter.deadline() == pytest.approx(4.5)
    empty = UnitCutter(UnitGeometry(deadline_grace_s=0.0, align_period_s=1.0))
    empty.push(_signal(16480), now=2.2)
    empty.arm_tick(2.2)
    assert empty.cut_if_tick(3.0) == []  # nothing since the last cut: the next unit simply starts on the tick
    assert empty.deadline() == pytest.approx(4.0)
    graced = UnitCutter(UnitGeometry(deadline_grace_s=0.25, align_period_s=1.0))
    graced.push(_signal(16480 + 800), now=2.2)
    graced.arm_tick(2.2)
    assert graced.cut_if_tick(3.2) == []  # the chunk that passes the tick may still come: it is split there
    assert [u.client_samples for u in graced.cut_if_tick(3.26)] == [800]
    off = UnitCutter(UnitGeometry(deadline_grace_s=0.0))
    off.push(_signal(16480 + 800), now=5.0)
    off.arm_tick(5.0)
    assert off.cut_if_tick(9.0) == [] and off.push(_signal(800), now=9.0) == [] and off.residual == 1600


def test_alignment_follows_the_live_sessions_when_it_has_a_floor() -> None:
    """align_min_sessions: a commit arms the tick only while live_sessions() reaches the floor, read at each commit."""
    live = [3]
    cutter = UnitCutter(UnitGeometry(deadline_grace_s=0.0, align_period_s=1.0, align_min_sessions=4,
                                     live_sessions=lambda: live[0]))
    cutter.push(_signal(16480 + 800), now=2.2)
    cutter.arm_tick(2.2)  # 3 live: below the floor, no tick
    assert cutter.cut_if_tick(3.5) == [] and cutter.residual == 800
    live[0] = 4
    cutter.arm_tick(3.5)  # at the floor: the partial unit ends on the tick at 4.0
    (short,) = cutter.cut_if_tick(4.01)
    assert short.client_samples == 800 and len(short.samples) == 16000
    assert UnitGeometry(align_min_sessions=4, live_sessions=lambda: 9).aligning() is False  # no period: off
    assert UnitGeometry(align_period_s=1.0, align_min_sessions=4).aligning() is True  # no count: the period rules
