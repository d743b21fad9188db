from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from gateway.vad.detector import WINDOW_MS, SpeechStarted, SpeechStopped, VadParams, VadStream
from gateway.vad.model import WINDOW_SAMPLES, SileroVad, default_model_path

RATE = 16000
PAD_S = 1.0  # silence around the utterance
SMOOTHING_MS = 200.0  # silero keeps a high probability for a few windows after the waveform ends


@pytest.fixture(scope="module")
def model() -> SileroVad:
    return SileroVad()


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """Real synthetic speech (espeak-ng) at 16 kHz, with 1 s of silence before and after."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed (apt-get install -y espeak-ng)")
    wav = tmp_path_factory.mktemp("vad") / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "Hello there, this is a test of the voice activity detector."],
                   check=True, capture_output=True)
    audio, rate = sf.read(wav, dtype="float32")
    audio16 = soxr.resample(audio, rate, RATE).astype(np.float32)
    pad = np.zeros(int(PAD_S * RATE), np.float32)
    return np.concatenate([pad, audio16, pad])


def reference_probs(audio: np.ndarray) -> np.ndarray:
    """silero-vad's own wrapper (torch) over the package's default ONNX file (`load_silero_vad(onnx=True)`'s, with
    its 8 kHz branch), not the 16 kHz export the gateway reads: the independent reference."""
    torch = pytest.importorskip("torch")
    from silero_vad.utils_vad import OnnxWrapper

    ref = OnnxWrapper(str(default_model_path().parent / "silero_vad.onnx"), force_onnx_cpu=True)
    n = len(audio) // WINDOW_SAMPLES
    return np.array([ref(torch.from_numpy(audio[k * WINDOW_SAMPLES:(k + 1) * WINDOW_SAMPLES].copy()), RATE).item()
                     for k in range(n)], np.float32)


def test_streaming_probabilities_match_silero_reference(model: SileroVad, speech: np.ndarray) -> None:
    ours = model.probabilities(model.new_state(), speech)
    np.testing.assert_allclose(ours, reference_probs(speech), atol=1e-5)


def test_chunking_does_not_change_decisions(model: SileroVad, speech: np.ndarray) -> None:
    whole = VadStream(model, VadParams())
    u = whole.feed(speech)
    chunked = VadStream(model, VadParams())
    probs, events = [], []
    rng = np.random.default_rng(0)
    pos = 0
    while pos < len(speech):
        n = int(rng.integers(100, 5000))  # arbitrary append sizes, not multiples of 512
        up = chunked.feed(speech[pos:pos + n])
        probs += up.probabilities
        events += up.events
        pos += n
    np.testing.assert_allclose(probs, u.probabilities, atol=1e-6)
    assert tuple(events) == u.events


def test_speech_detected_with_spec_padding(model: SileroVad, speech: np.ndarray) -> None:
    params = VadParams(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    u = VadStream(model, params, origin_ms=0.0).feed(speech, item_start_ms=0.0)
    starts = [e for e in u.events if isinstance(e, SpeechStarted)]
    stops = [e for e in u.events if isinstance(e, SpeechStopped)]
    assert starts and stops and u.is_speech and u.onset_confirmed
    voiced = np.flatnonzero(np.abs(speech) > 0.02)  # independent: where the waveform has energy
    first_ms, last_ms = 1000.0 * voiced[0] / RATE, 1000.0 * voiced[-1] / RATE
    onset = starts[0].onset_ms
    assert first_ms - 2 * WINDOW_MS <= onset <= first_ms + 300.0
    assert starts[0].audio_start_ms == pytest.approx(onset - 300.0)
    end = stops[-1].audio_end_ms
    assert last_ms - 300.0 <= end <= last_ms + SMOOTHING_MS  # the model's recurrent state lags the offset
    assert end % WINDOW_MS == pytest.approx(0.0, abs=1e-6)  # the end of a speech window
    # the stop is reported only after silence_duration_ms of non-speech: it needs the trailing silence
    short_tail = VadStream(model, params).feed(speech[: int((end / 1000.0 + 0.3) * RATE)])
    assert not [e for e in short_tail.events if isinstance(e, SpeechStopped) and e.audio_end_ms == end]


def test_prefix_padding_clamped_to_item_start(model: SileroVad, speech: np.ndarray) -> None:
    u = VadStream(model, VadParams(prefix_padding_ms=5000)).feed(speech, item_start_ms=700.0)
    start = next(e for e in u.events if isinstance(e, SpeechStarted))
    assert start.audio_start_ms == 700.0


def test_silence_and_noise_are_not_speech(model: SileroVad) -> None:
    rng = np.random.default_rng(1)
    silence = np.zeros(3 * RATE, np.float32)
    noise = (0.05 * rng.standard_normal(3 * RATE)).astype(np.float32)
    for audio in (silence, noise):
        u = VadStream(model, VadParams()).feed(audio)
        assert u.events == () and not u.is_speech and not u.onset_confirmed


def test_threshold_one_never_triggers(model: SileroVad, speech: np.ndarray) -> None:
    u = VadStream(model, VadParams(threshold=1.0)).feed(speech)
    assert u.events == ()


def test_sessions_have_independent_state(model: SileroVad, speech: np.ndarray) -> None:
    a, b = VadStream(model, VadParams()), VadStream(model, VadParams())
    a.feed(speech[: len(speech) // 2])
    fresh = VadStream(model, VadParams()).feed(speech)
    assert b.feed(speech).probabilities == fresh.probabilities


def test_reset_restores_fresh_state(model: SileroVad, speech: np.ndarray) -> None:
    s = VadStream(model, VadParams())
    first = s.feed(speech)
    s.reset(origin_ms=0.0)
    assert s.feed(speech) == first


def test_params_from_turn_detection() -> None:
    p = VadParams.from_turn_detection({"type": "server_vad", "threshold": 0.7, "prefix_padding_ms": 100,
                                       "silence_duration_ms": 800, "create_response": True})
    assert (p.threshold, p.prefix_padding_ms, p.silence_duration_ms) == (0.7, 100, 800)
    with pytest.raises(ValueError):
        VadParams(threshold=1.5)


def test_gateway_vad_does_not_import_torch() -> None:
    code = ("import sys, numpy as np; from gateway.vad.detector import VadStream, VadParams; "
            "from gateway.vad.model import SileroVad; m = SileroVad(); "
            "VadStream(m, VadParams()).feed(np.zeros(1024, np.float32)); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_window_shape_checked(model: SileroVad) -> None:
    with pytest.raises(ValueError):
        model.window_probability(model.new_state(), np.zeros(256, np.float32))
