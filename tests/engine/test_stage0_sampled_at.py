"""A sampled token's event carries when it was sampled on the host's monotonic clock (`TokenEvent.sampled_at`),
which the gateway's P13 measurement (token sampled -> transcript delta sent) reads across processes."""

from __future__ import annotations

import time

from engine.stage0 import DecodeRules, Fence, SamplingParams, Stage0Config, Stage0Engine, TokenEvent
from tests.engine.test_stage0_helpers import FakeFrontEnd, tiny_llm, tiny_tokenizer, unit_pcm


def test_each_sampled_token_is_stamped_inside_the_step_that_sampled_it() -> None:
    events: list = []
    engine = Stage0Engine(tiny_llm(), tiny_tokenizer(), FakeFrontEnd(), events.append, Stage0Config(max_sessions=1),
                          DecodeRules(force_listen_count=0))
    engine.open("s", Fence(1, 0), params=SamplingParams(temperature=1.5, seed=3))
    engine.run_until_idle()
    windows = []  # (monotonic before the step, after it, events it emitted)
    for k in range(3):
        engine.append("s", Fence(1, 0, seq=k), unit_pcm(3, k))
        while True:
            before, n = time.monotonic(), len(events)
            busy = engine.step()
            windows.append((before, time.monotonic(), events[n:]))
            if not busy:
                break
    # a token is sampled in one step and its event leaves with the next one, when it is fed (with its hidden
    # state): the stamp lies inside the step before the one that emitted it, or inside that step
    stamped = [(windows[max(i - 1, 0)][0], hi, e) for i, (_, hi, new) in enumerate(windows)
               for e in new if isinstance(e, TokenEvent)]
    assert len(stamped) >= 3
    for lo, hi, e in stamped:
        assert lo <= e.sampled_at <= hi, (lo, e.sampled_at, hi)
    assert len({e.sampled_at for _, _, e in stamped}) == len(stamped)  # one stamp per token, not per step
