"""What `duplex serve` says while tritonserver loads (serve/tritonserver.py `load_progress`): Triton answers HTTP
only after its models load, so the progress line reads each model's state from the server's log. The lines below
are a real CPU start's (tests/e2e/profiles/scripted-first-codes.yaml), in the order they came."""

from __future__ import annotations

from serve.tritonserver import load_progress

MODELS = ("stage0", "tts", "token2wav", "duplex")
LOG = [
    'I1208 03:17:59.120051 1 model_lifecycle.cc:472] "loading: stage0:1"',
    'I1208 03:18:00.901490 1 model_lifecycle.cc:838] "successfully loaded \'duplex\'"',
    'I1208 03:18:03.859128 2 adapter.py:205] "stage0: warm-up starts (the model turns ready after it)"',
    'I1208 03:18:03.891258 2 adapter.py:206] "stage0: audio front end: batch 1"',
    'I1208 03:18:03.913107 2 adapter.py:207] "stage0: warm-up finished in 0.1 s"',
    'I1208 03:18:03.918641 1 model_lifecycle.cc:838] "successfully loaded \'stage0\'"',
    'I1208 03:18:04.822067 3 adapter.py:205] "tts: warm-up starts (the model turns ready after it)"',
    'I1208 03:18:21.634422 3 adapter.py:206] "tts: tts warm-up 1/18: compiled step batch 4 kv 256 (16.8 s)"',
    'I1208 03:18:21.636821 3 adapter.py:206] "tts: tts warm-up 2/18: compiled step batch 4 kv 512 (16.8 s)"',
]


def test_each_model_reads_loading_then_its_last_warm_up_step_then_loaded() -> None:
    assert load_progress([], MODELS) == dict.fromkeys(MODELS, "loading")
    assert load_progress(LOG[:4], MODELS) == {"stage0": "warm-up starts", "tts": "loading",
                                              "token2wav": "loading", "duplex": "loaded"}
    assert load_progress(LOG, MODELS) == {"stage0": "loaded", "tts": "warm-up 2/18", "token2wav": "loading",
                                          "duplex": "loaded"}


def test_notes_of_other_models_and_lines_that_are_not_warm_up_steps_change_nothing() -> None:
    lines = [*LOG[:1], 'I1 adapter.py:206] "vision: warm-up 1/2: x"', 'I1 adapter.py:206] "tts: shape miss"']
    assert load_progress(lines, MODELS) == dict.fromkeys(MODELS, "loading")
