"""codec.coalesce / codec.split: a stage's outputs travel to the pipeline as one `batch` response."""

from __future__ import annotations

import gc
import json
import time
import weakref

import numpy as np

from model_repository.common.codec import StageOutput, coalesce, output_arrays, split
from model_repository.common.workarounds import Graveyard


def wire(out: StageOutput) -> StageOutput:
    """Through the tensors of one response and back, as the pipeline reads them."""
    arrays = output_arrays(out)
    return StageOutput(json.loads(arrays["EVENT"].reshape(-1)[0]), audio=arrays["AUDIO"].reshape(-1),
                       tokens=arrays["TOKENS"].reshape(-1), hidden=arrays["HIDDEN"].reshape(-1))


def test_split_inverts_coalesce_through_the_wire() -> None:
    rng = np.random.default_rng(0)
    outs = [StageOutput({"type": "decision", "unit": 0}),
            StageOutput({"type": "tts_input", "unit": 0}, tokens=np.array([5, 6, 7]),
                        hidden=rng.standard_normal(12).astype(np.float32)),
            StageOutput({"type": "audio", "unit": 0}, audio=np.arange(-4, 4, dtype=np.int16)),
            StageOutput({"type": "audio_tokens"}, tokens=np.array([], dtype=np.int64)),
            StageOutput({"type": "unit_done", "unit": 0}, audio=np.array([9], dtype=np.int16), tokens=np.array([1]))]
    back = split(wire(coalesce(outs)))
    assert [o.event for o in back] == [o.event for o in outs]
    for got, want in zip(back, outs, strict=True):
        for name in ("audio", "tokens", "hidden"):
            w = getattr(want, name)
            w = np.zeros(0) if w is None else w
            assert np.array_equal(getattr(got, name), w), (want.event, name)
    assert back[2].audio.dtype == np.int16 and back[1].hidden.dtype == np.float32


def test_nothing_coalesced_is_an_empty_batch_and_other_outputs_pass_through() -> None:
    assert split(wire(coalesce([]))) == []
    single = wire(StageOutput({"type": "error", "code": "stale_fence"}))
    assert split(single) == [single]


def test_graveyard_holds_objects_for_a_while_then_releases_them_here() -> None:
    class Obj:
        pass

    yard = Graveyard(hold_s=0.2, max_items=3)
    first = Obj()
    ref = weakref.ref(first)
    yard.keep(first, [1, 2])
    del first
    gc.collect()
    assert ref() is not None and len(yard) == 1          # held past the caller's last reference
    time.sleep(0.25)
    yard.keep(Obj())                                      # any later call sweeps the old ones
    gc.collect()
    assert ref() is None and len(yard) == 1
    for _ in range(5):
        yard.keep(Obj())
    assert len(yard) == 3                                 # bounded


def test_graveyard_release_all_empties_it() -> None:
    yard = Graveyard(hold_s=60.0)
    yard.keep(object())
    yard.release_all(settle_s=0.01)
    assert len(yard) == 0
