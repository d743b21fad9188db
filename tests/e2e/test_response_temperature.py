"""`response.create{response:{temperature}}` reaches stage0 through the real stack (protocol.md §2.8).

Three sessions, one after the other, with the same audio and the same seed (given: the default is a fresh random
seed per session, echoed in `extra_body.seed`): auto_response off, so the
first unit listens without sampling; then a commit and a `response.create` whose units follow. Greedy
(temperature 0) must change what the model says in those units; a `response.create` naming the session's own
temperature carries no override and must say exactly what one naming none says (the control: the difference
comes from the override, not from run-to-run noise).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.e2e.stack import SHARED_ENV, profile_engine
from tests.e2e.wire import cleanup, close_session, fit_units, response_after_unit0, unit_of
from tests.gateway_ops.wire import opened

pytestmark = pytest.mark.e2e
# force_listen_count=0: the response's units sample from the first one (the stack
# test_conformance shares)
STACK_ENV = SHARED_ENV
SESSION_T = 0.7  # the session default (protocol.md §2.2)
SEED = 11
OWNED = (1, 2)  # the units sent after response.create
# one unit more than the owned ones: its decision comes after all of unit 2's text (text deltas stream per piece,
# so unit 2's own first delta is no sign that its text is complete)
UNITS = 1 + len(OWNED) + 1


async def _owned_output(addr: str, speech: np.ndarray, response: dict[str, Any]) -> list[tuple]:
    """What the model did in the response's units: (event type, unit, text) of its listens and text deltas."""
    updated, events = await response_after_unit0(addr, fit_units(speech, UNITS), SEED, response, OWNED[-1] + 1,
                                                 session={"output_modalities": ["text"]})
    assert updated["session"]["extra_body"]["seed"] == SEED
    return [(e["type"], unit, e.get("delta")) for e in events
            if (unit := unit_of(e)) in OWNED
            and e["type"] in ("response.listen", "response.output_text.delta")]


@pytest.mark.timeout(240)
@pytest.mark.skipif(profile_engine().endswith("loopback"), reason="the loopback stand-in does not sample")
async def test_response_temperature_changes_what_stage0_samples(addr: str, speech: np.ndarray) -> None:
    greedy = await _owned_output(addr, speech, {"temperature": 0.0})
    plain = await _owned_output(addr, speech, {})
    same = await _owned_output(addr, speech, {"temperature": SESSION_T})
    assert plain == same, "no override -> the same units (deterministic per seed)"
    assert plain and greedy != plain, (greedy, plain)


async def test_each_session_gets_its_own_random_seed_unless_given(addr: str) -> None:
    seeds = []
    for _ in range(2):
        c, created = await opened(addr)
        async with cleanup(c):
            seeds.append(created["session"]["extra_body"]["seed"])
            await close_session(c)
    assert seeds[0] != seeds[1] and all(isinstance(s, int) for s in seeds)
