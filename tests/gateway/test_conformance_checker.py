"""The checker itself must fail on broken streams: mutate a recorded conformant run and expect violations."""

from __future__ import annotations

import copy

import pytest

from tests.gateway import conformance
from tests.gateway.fake_runtime import Speak
from tests.gateway.scenario import close, session, stream_units


@pytest.fixture
async def recorded() -> list[dict]:
    async with session() as (c, rt):
        rt.plan[1] = Speak("Sure, one ", 1000)
        rt.plan[2] = Speak("plus one is two.", 840, end_of_turn=True)
        await stream_units(c, 3)
        await c.until("rate_limits.updated")
        return await close(c)


def _idx(events: list[dict], t: str) -> int:
    return next(i for i, e in enumerate(events) if e["type"] == t)


def _mutations(ev: list[dict]) -> dict[str, list[dict]]:
    out = {}
    m = copy.deepcopy(ev)
    i = _idx(m, "response.output_audio.delta")
    m[i], m[i + 1] = m[i + 1], m[i]
    out["pair order"] = m
    m = copy.deepcopy(ev)
    del m[_idx(m, "rate_limits.updated")]
    out["missing R8"] = m
    m = copy.deepcopy(ev)
    i = _idx(m, "response.speak")
    m.insert(i + 1, dict(m[i], event_id="evt_dup"))
    out["double speak"] = m
    m = copy.deepcopy(ev)
    m[_idx(m, "response.output_audio_transcript.done")]["transcript"] = "something else"
    out["C-5 transcript"] = m
    m = copy.deepcopy(ev)
    m[_idx(m, "response.output_audio.delta")]["server_event_seq"] += 5
    out["seq gap"] = m
    m = copy.deepcopy(ev)
    i = _idx(m, "response.output_audio.done")
    m.insert(i, m.pop(_idx(m, "response.content_part.done")))
    out["R5/R6 order"] = m
    m = copy.deepcopy(ev)
    m.pop(_idx(m, "conversation.item.added"))
    out["missing R2"] = m
    m = copy.deepcopy(ev)
    m[_idx(m, "response.output_audio.delta")]["metadata"]["audio_text_mark"]["text_chars"] += 1
    out["bad mark"] = m
    m = copy.deepcopy(ev)
    m[_idx(m, "response.speak")]["event_id"] = m[0]["event_id"]
    out["event_id reuse"] = m
    return out


async def test_recorded_run_is_conformant(recorded: list[dict]) -> None:
    assert conformance.check(recorded) == []


async def test_every_mutation_is_caught(recorded: list[dict]) -> None:
    for name, stream in _mutations(recorded).items():
        assert conformance.check(stream), f"checker missed: {name}"


async def test_cli_over_a_recorded_jsonl(recorded: list[dict], tmp_path) -> None:  # noqa: ANN001
    import json

    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in recorded))
    assert conformance.main([str(path)]) == 0
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(json.dumps(e) for e in recorded if e["type"] != "rate_limits.updated"))
    assert conformance.main([str(broken)]) == 1
