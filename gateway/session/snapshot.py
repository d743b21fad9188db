"""A session's state as JSON, and back: what another gateway needs to go on with a session whose gateway died
(docs/deploy.md §11, gateway/directory/adopt.py).

Kept: the config as the client last set it (`config_json`, written only when it changes: a `ref_audio` clip makes
it large), the fence counters the runtime checks (epoch, model turn, acknowledged appends, the next model unit and
the input clock), the conversation record, and every response whose playback ledger entry may still move (the
active one, the last that carried audio, any whose history is not final) with its ledger entry.
Not kept, by design: audio not yet sent to the runtime (the open input item and the partial unit), the server VAD
and overlap episode state, a deferred commit and pending turn reservations, stage metrics of past units; a new
owner starts those afresh (§11 lists them). Monotonic times travel as ages, so they survive a change of process.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from gateway.protocol.config import ResponseOptions, SessionConfig
from gateway.protocol.validate import RefAudio
from gateway.session.history import HistoryItem
from gateway.session.playback import PlaybackEntry
from gateway.session.responses import Response
from gateway.session.session import DuplexSession

Json = dict[str, Any]
VERSION = 1
_TUPLES = ("output_modalities", "tools")  # SessionConfig fields that are tuples (JSON has lists)
_BYTES = ("data", "pcm16k")  # RefAudio fields that are bytes
# NOTE: field names read once: dataclasses.asdict deep-copies and cost ~10 us per history item (measured), which
# the write-through pays on every write (gateway/directory/replica.py)
_HISTORY_FIELDS = tuple(f.name for f in dataclasses.fields(HistoryItem))


# ---- config ---------------------------------------------------------------------------------------------
def config_json(config: SessionConfig) -> Json:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    ref = config.ref_audio
    if ref is not None:
        out["ref_audio"] = {f.name: (base64.b64encode(getattr(ref, f.name)).decode() if f.name in _BYTES
                                     else getattr(ref, f.name)) for f in dataclasses.fields(ref)}
    for name in _TUPLES:
        out[name] = list(out[name])
    return out


def config_from_json(raw: Json) -> SessionConfig:
    values = dict(raw)
    for name in _TUPLES:
        values[name] = tuple(values[name])
    ref = values.get("ref_audio")
    if ref is not None:
        values["ref_audio"] = RefAudio(**{k: (base64.b64decode(v) if k in _BYTES else v) for k, v in ref.items()})
    return SessionConfig(**values)


# ---- responses ------------------------------------------------------------------------------------------
def _playback_json(entry: PlaybackEntry, now: float) -> Json:
    out = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    out["first_send_at"] = None if entry.first_send_at is None else now - entry.first_send_at  # an age
    out["marks"] = [list(m) for m in entry.marks]
    return out


def _playback_from(raw: Json, now: float) -> PlaybackEntry:
    values = dict(raw)
    values["first_send_at"] = None if raw["first_send_at"] is None else now - raw["first_send_at"]
    values["marks"] = [tuple(m) for m in raw["marks"]]
    return PlaybackEntry(**values)


def _response_json(resp: Response, now: float) -> Json:
    out = {f.name: getattr(resp, f.name) for f in dataclasses.fields(resp) if f.name not in ("metrics", "playback")}
    out["options"] = dataclasses.asdict(resp.options)
    out["playback"] = None if resp.playback is None else _playback_json(resp.playback, now)
    return out


def _response_from(raw: Json, now: float) -> Response:
    values = {k: v for k, v in raw.items() if k not in ("options", "playback")}
    playback = None if raw["playback"] is None else _playback_from(raw["playback"], now)
    return Response(**values, options=ResponseOptions(**raw["options"]), playback=playback)


def _kept_responses(session: DuplexSession) -> list[Response]:
    """The responses a later event can still reach through the ledger (a `playback.ack`, a truncate, a clear)."""
    r = session.responses
    keep = {r.last_audio_response, r.active.id if r.active is not None else None}
    return [resp for rid, resp in r.by_id.items()
            if rid in keep or (resp.playback is not None and not resp.playback.history_final)]


# ---- the session --------------------------------------------------------------------------------------------
def capture(session: DuplexSession) -> Json:
    """The session's state (without its config), as JSON-ready values."""
    now = session.clock()
    r, feed = session.responses, session.inputs.feed
    kept = _kept_responses(session)
    return {
        "v": VERSION,
        "epoch": r.epoch,
        "model_turn_id": r.model_turn_id,
        "acked_appends": session.lane.acked_appends,
        "config_generation": session.config_generation,
        "next_unit": feed.cutter.next_index,
        "clock_ms": feed.clock_ms,
        "history": [{name: getattr(item, name) for name in _HISTORY_FIELDS} for item in r.history.items()],
        "responses": [_response_json(resp, now) for resp in kept],
        "active": r.active.id if r.active is not None else None,
        "last_audio": r.last_audio_response,
        "completed": [resp.id for resp in kept if r.was_completed(resp.id)],
    }


def restore(session: DuplexSession, state: Json) -> None:
    """Put `state` (from `capture`) into a session just built with the same config and key, before it runs."""
    if state.get("v") != VERSION:
        raise ValueError(f"session state version {state.get('v')!r}, expected {VERSION}")
    now = session.clock()
    responses = [_response_from(raw, now) for raw in state["responses"]]
    session.responses.restore(epoch=state["epoch"], model_turn_id=state["model_turn_id"],
                              history=[HistoryItem(**item) for item in state["history"]], responses=responses,
                              active=state["active"], last_audio=state["last_audio"],
                              completed=set(state["completed"]))
    session.lane.restore(acked_appends=state["acked_appends"])
    session.restore_config_generation(state["config_generation"])
    session.inputs.feed.restore(next_unit=state["next_unit"], clock_ms=state["clock_ms"])
