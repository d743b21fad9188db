"""The batched server VAD (gateway/vad/batcher.py) against the one-stream path, bit for bit.

A session's probabilities and recurrent state must be what `SileroVad.window_probability`, window by window,
gives it, whichever other sessions (at whatever states, with however many windows) share its rounds.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import numpy as np
import pytest

from gateway.vad.batcher import VadBatcher
from gateway.vad.detector import VadParams, VadStream
from gateway.vad.model import WINDOW_SAMPLES, SileroVad, VadState

RATE = 16000


@pytest.fixture(scope="module")
def model() -> SileroVad:
    return SileroVad()


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """[n] float32 at 16 kHz: espeak-ng's voice between silences when installed, else a voiced-like signal."""
    pad = np.zeros(RATE // 2, np.float32)
    if shutil.which("espeak-ng") is not None:
        import soundfile as sf
        import soxr

        wav = tmp_path_factory.mktemp("vad_batch") / "speech.wav"
        subprocess.run(["espeak-ng", "-w", str(wav), "Hello there, is the batch the same as one stream?"],
                       check=True, capture_output=True)
        audio, rate = sf.read(wav, dtype="float32")
        return np.concatenate([pad, soxr.resample(audio, rate, RATE).astype(np.float32), pad])
    t = np.arange(2 * RATE) / RATE
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)  # syllable-rate modulation of a 140 Hz harmonic series
    voiced = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 12)) * envelope
    return np.concatenate([pad, (0.3 * voiced).astype(np.float32), pad])


def clip(audio: np.ndarray, start_window: int, n_windows: int) -> np.ndarray:
    """[n_windows, 512] of `audio`, wrapping around."""
    idx = (start_window * WINDOW_SAMPLES + np.arange(n_windows * WINDOW_SAMPLES)) % len(audio)
    return audio[idx].reshape(n_windows, WINDOW_SAMPLES)


def advanced_state(model: SileroVad, audio: np.ndarray, n_windows: int) -> VadState:
    state = model.new_state()
    model.probabilities(state, clip(audio, 0, n_windows).reshape(-1))
    return state


def copy_state(state: VadState) -> VadState:
    return VadState(state.rnn.copy(), state.context.copy())


def one_stream(model: SileroVad, state: VadState, windows: np.ndarray) -> np.ndarray:
    return np.array([model.window_probability(state, w) for w in windows], np.float32)


def assert_same_state(a: VadState, b: VadState) -> None:
    assert np.array_equal(a.rnn, b.rnn) and np.array_equal(a.context, b.context)
    assert a.rnn.shape == (2, 1, 128) and a.context.shape == (64,)


def test_model_rows_are_independent(model: SileroVad, speech: np.ndarray) -> None:
    """The premise: one ORT call on B rows gives each row what it gives that row alone."""
    b = 9
    states = [advanced_state(model, speech, 3 * i) for i in range(b)]
    x = np.stack([np.concatenate([s.context, clip(speech, 7 * i, 1)[0]])
                  for i, s in enumerate(states)])  # [B, 576]
    rnn = np.concatenate([s.rnn for s in states], axis=1)  # [2, B, 128]
    probs, rnn_out = model.run(x, rnn)
    for i in range(b):
        p1, r1 = model.run(x[i:i + 1], np.ascontiguousarray(rnn[:, i:i + 1]))
        assert p1[0] == probs[i] and np.array_equal(r1[:, 0], rnn_out[:, i])


async def test_batcher_equals_per_window_calls_with_uneven_counts(model: SileroVad, speech: np.ndarray) -> None:
    counts = [3, 1, 0, 7, 4, 4, 2, 11]
    starts = [advanced_state(model, speech, 5 * i) for i in range(len(counts))]  # every session at its own state
    windows = [clip(speech, 13 * i + 2, n) for i, n in enumerate(counts)]
    batcher = VadBatcher(model)
    states = [copy_state(s) for s in starts]
    got = await asyncio.gather(*(batcher.probabilities(s, w) for s, w in zip(states, windows, strict=True)))
    for start, state, w, probs in zip(starts, states, windows, got, strict=True):
        ref_state = copy_state(start)
        assert np.array_equal(probs, one_stream(model, ref_state, w))  # bitwise, in window order
        assert_same_state(state, ref_state)
    # one flush: round r holds the sessions with more than r windows
    assert (batcher.stats.flushes, batcher.stats.rounds, batcher.stats.windows) == (1, max(counts), sum(counts))


async def test_session_alone_equals_session_batched_with_others(model: SileroVad, speech: np.ndarray) -> None:
    """Session A's chunk stream, alone vs sharing every round with others at other states and chunk sizes."""
    chunks = [clip(speech, k * 5, 5) for k in range(len(speech) // (5 * WINDOW_SAMPLES))]
    alone, batched = VadBatcher(model), VadBatcher(model)
    a_alone, a_batched = model.new_state(), model.new_state()
    others = [advanced_state(model, speech[::-1].copy(), 4 * i + 1) for i in range(6)]
    rng = np.random.default_rng(0)
    for k, chunk in enumerate(chunks):
        p_alone = await alone.probabilities(a_alone, chunk)
        extra = [batched.probabilities(s, clip(speech, 3 * k + i, int(rng.integers(1, 9))))
                 for i, s in enumerate(others)]
        p_batched, *_ = await asyncio.gather(batched.probabilities(a_batched, chunk), *extra)
        assert np.array_equal(p_alone, p_batched)
        assert_same_state(a_alone, a_batched)
    assert alone.stats.mean_batch == 1.0 and batched.stats.mean_batch > 4.0


async def test_one_state_twice_is_sequential(model: SileroVad, speech: np.ndarray) -> None:
    """Two calls on one state in one loop iteration: the second runs after the first, in call order."""
    batcher = VadBatcher(model)
    state, ref = model.new_state(), model.new_state()
    first, second = clip(speech, 10, 3), clip(speech, 13, 2)
    p1, p2 = await asyncio.gather(batcher.probabilities(state, first), batcher.probabilities(state, second))
    assert np.array_equal(np.concatenate([p1, p2]), one_stream(model, ref, np.concatenate([first, second])))
    assert_same_state(state, ref)
    assert batcher.stats.flushes == 2


async def test_cancelled_call_is_dropped(model: SileroVad, speech: np.ndarray) -> None:
    """A closing session's pending windows never run; the others' results are unchanged."""
    batcher = VadBatcher(model)
    gone, kept, ref = model.new_state(), model.new_state(), model.new_state()
    task = asyncio.create_task(batcher.probabilities(gone, clip(speech, 20, 4)))
    await asyncio.sleep(0)  # the task is queued in the batcher; the flush is scheduled
    task.cancel()
    probs = await batcher.probabilities(kept, clip(speech, 20, 4))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert np.array_equal(probs, one_stream(model, ref, clip(speech, 20, 4)))
    assert_same_state(gone, model.new_state())  # untouched
    assert batcher.stats.windows == 4


class FailingModel(SileroVad):
    """Fails any call whose batch holds a row starting with the marker sample, as ORT raises (a RuntimeError)."""

    MARK = 7.0

    def run(self, x: np.ndarray, rnn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if (x[:, 64] == self.MARK).any():
            raise RuntimeError("ORT failed")
        return super().run(x, rnn)


async def test_ort_failure_fails_only_the_affected_call(speech: np.ndarray) -> None:
    model = FailingModel()
    batcher = VadBatcher(model)
    bad_windows = clip(speech, 30, 3).copy()
    bad_windows[1, 0] = FailingModel.MARK  # its second window fails
    good, bad, ref = model.new_state(), model.new_state(), model.new_state()
    results = await asyncio.gather(batcher.probabilities(good, clip(speech, 30, 3)),
                                   batcher.probabilities(bad, bad_windows), return_exceptions=True)
    assert np.array_equal(results[0], one_stream(model, ref, clip(speech, 30, 3)))
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "ORT failed"
    # the batcher keeps serving
    more = clip(speech, 33, 1)
    assert np.array_equal(await batcher.probabilities(good, more), one_stream(model, ref, more))


def test_window_shape_checked(model: SileroVad) -> None:
    with pytest.raises(ValueError):
        asyncio.run(VadBatcher(model).probabilities(model.new_state(), np.zeros((2, 256), np.float32)))


async def test_stream_feed_batched_equals_feed(model: SileroVad, speech: np.ndarray) -> None:
    """VadStream: the served (batched) path gives the same probabilities and speech events as the direct one,
    on appends of arbitrary sizes, with another session streaming different audio in the same rounds."""
    direct, served = VadStream(model, VadParams()), VadStream(model, VadParams())
    other = VadStream(model, VadParams(threshold=0.3))
    batcher = VadBatcher(model)
    rng = np.random.default_rng(1)
    pos, events = 0, 0
    while pos < len(speech):
        n = int(rng.integers(100, 5000))
        want = direct.feed(speech[pos:pos + n], item_start_ms=0.0)
        got, _ = await asyncio.gather(served.feed_batched(batcher, speech[pos:pos + n], item_start_ms=0.0),
                                      other.feed_batched(batcher, speech[::-1][pos:pos + n].copy()))
        assert got == want and got.probabilities == want.probabilities
        events += len(got.events)
        pos += n
    if shutil.which("espeak-ng") is not None:
        assert events >= 2  # a start and a stop were compared


async def test_reset_after_batched_feed(model: SileroVad, speech: np.ndarray) -> None:
    s = VadStream(model, VadParams())
    batcher = VadBatcher(model)
    first = await s.feed_batched(batcher, speech)
    s.reset(origin_ms=0.0)
    assert await s.feed_batched(batcher, speech) == first


def test_gateway_state_loads_one_batcher() -> None:
    """The app's loader: one model and one batcher per process, made on first use."""
    from gateway.settings import GatewaySettings
    from gateway.state import GatewayState
    from tests.gateway.fake_runtime import FakeRuntime

    state = GatewayState(GatewaySettings(), FakeRuntime())
    assert state.vad is None
    batcher = state.vad_batcher()
    assert isinstance(batcher, VadBatcher) and state.vad_batcher() is batcher
