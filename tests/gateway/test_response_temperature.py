"""`response.create{response:{temperature}}` (protocol.md §2.8): applied to the thinker units the response owns.

The units cut while the response is active carry the temperature on their append (UnitSubmission.temperature,
on the wire the append's CONFIG); units of no response, or of a response whose temperature is the session's,
carry none.
"""

from __future__ import annotations

import json

import numpy as np

from gateway.runtime.base import Fence, UnitSubmission
from gateway.runtime.triton_wire import build_request
from tests.gateway.fake_runtime import Speak
from tests.gateway.harness import append
from tests.gateway.scenario import assert_conformant, close, session, stream_units

HOT = 1.3
SESSION_T = 0.7  # the session default (protocol.md §2.2)


async def _unit_listened(c, unit: int) -> None:  # noqa: ANN001
    await c.until("response.listen", model_unit_index=unit)


async def test_owned_units_carry_the_response_temperature() -> None:
    async with session(update={"extra_body": {"auto_response": False}}) as (c, rt):
        await stream_units(c, 1)  # unit 0: no response
        await _unit_listened(c, 0)
        await c.send(append(100))
        await c.send({"type": "input_audio_buffer.commit"})  # unit 1 (padded): still no response
        await _unit_listened(c, 1)
        rt.plan[2] = Speak("one ", 1000)
        rt.plan[3] = Speak("two.", 1000, end_of_turn=True)
        await c.send({"type": "response.create", "response": {"temperature": HOT}})
        await c.until("response.created")
        await c.send(append(1000))  # units 2 and 3 belong to that response
        await c.send(append(1000))
        done = (await c.until("response.done"))[-1]["response"]
        assert done["status"] == "completed" and done["output"][0]["content"][0]["transcript"] == "one two."
        await c.send(append(1000))  # unit 4: the response is over
        await _unit_listened(c, 4)
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("conversation.item.done")
        rt.plan[5] = Speak("three.", 1000, end_of_turn=True)
        await c.send({"type": "response.create", "response": {"temperature": SESSION_T}})  # = the session's
        await c.until("response.created")
        await c.send(append(1000))  # unit 5
        await c.until("response.done")
        events = await close(c)
    assert_conformant(events)
    sent = {u.unit_index: u.temperature for u in rt.units_seen}
    assert sent == {0: None, 1: None, 2: HOT, 3: HOT, 4: None, 5: None}


async def test_no_override_when_the_response_names_no_temperature() -> None:
    async with session(update={"temperature": 0.4}) as (c, rt):
        rt.plan[1] = Speak("hi.", 1000, end_of_turn=True)
        await stream_units(c, 1)
        await _unit_listened(c, 0)
        await c.send(append(1000))  # unit 1 speaks: a model-started response, session options only
        await c.until("response.done")
        events = await close(c)
    assert_conformant(events)
    assert [u.temperature for u in rt.units_seen] == [None, None]


def test_append_config_on_the_wire() -> None:
    pcm = np.zeros(16000, np.float32).tobytes()
    hot = build_request("duplex", 1, "a", "append", Fence(1, 0, 1), batch_dim=True,
                        unit=UnitSubmission(1, pcm, temperature=0.0))
    config = next(i for i in hot["inputs"] if i.name() == "CONFIG")
    assert config.shape() == [1, 1] and config.datatype() == "BYTES"
    assert json.loads(config._raw_content[4:]) == {"thinker": {"temperature": 0.0}}  # BYTES: 4-byte length prefix
    plain = build_request("duplex", 1, "a", "append", Fence(1, 0, 1), batch_dim=True, unit=UnitSubmission(1, pcm))
    assert "CONFIG" not in [i.name() for i in plain["inputs"]]
