"""One simulated user over `/v1/realtime`: speech in at exactly 1x real time, the assistant's audio into a 1x player.

The user streams continuously (protocol.md §8.6 U-2) in 200 ms appends scheduled on an absolute clock, so a
slow event loop shows up as send lag instead of silently slowing the input. Server VAD (`turn_detection:
server_vad`) decides the commits. It speaks one short sentence, then sends silence, and speaks again:
- against sampled decisions: once it has been silent for `MIN_SILENCE_S` and the assistant is quiet (no
  active response, the simulated player drained), or after `MAX_SILENCE_S` at the latest;
- against a scripted plan (`plan`, from the deploy profile): so that its VAD commit lands early in the first
  speak unit of the plan's next turn (`COMMIT_INTO_UNIT_S`), on the unit grid it rebuilds (grid.py). The
  commit then closes that unit, the unit speaks, and commit -> first audio is the server's latency, as with
  a model that answers the user; and the speech falls in the plan's listen units, so it never barges in. With `cancel_every_s` it sends `response.cancel` at that
period, each time while a response's audio is streaming (barge-in). Every receipt is stamped on the client's
monotonic clock; `UserLog` keeps the raw stamps and `report.py` derives the figures. The load generator
needs only the standard library, numpy, websockets and PyYAML (the GPU host has no package index), hence its
own small URL and percentile helpers instead of the `clients` package (which pulls in soundfile and soxr).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import numpy as np
import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from bench.loadgen.grid import INPUT_RATE, UnitGrid, plan_speaks

OUTPUT_RATE = 24_000
APPEND_S = 0.2
APPEND_SAMPLES = int(INPUT_RATE * APPEND_S)
MIN_SILENCE_S = 1.5
MAX_SILENCE_S = 8.0
OPEN_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
CANCEL_POLL_S = 0.05
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # protocol.md §1.5
FORCE_LISTEN_UNITS = 3  # the first units of a session listen (set explicitly: the plan's grid counts on it)
VAD_SILENCE_S = 0.5  # server VAD's silence_duration_ms default: speech end -> commit
COMMIT_INTO_UNIT_S = 0.5  # where in the first speak unit to aim the commit (it lands 0.15-0.3 s early: the
# fixtures end in silence and VAD counts from the last speech window)
MAX_LAG_S = 0.25  # later than this the gateway may pad units with silence (§8.6 U-3): the grid is lost
CANCEL_ID = "lg-cancel-"  # event_id prefix of our cancels: a `response_not_active` for one is a race, not a fault
SESSION_CONFIG: dict[str, Any] = {
    "type": "realtime",
    "output_modalities": ["audio"],
    "force_listen_count": FORCE_LISTEN_UNITS,
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}, "turn_detection": {"type": "server_vad"}},
              "output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}}},
}


@dataclass
class ResponseLog:
    response_id: str
    created_t: float
    audio_t: list[float] = field(default_factory=list)  # receipt of each audio delta
    audio_ms: list[float] = field(default_factory=list)  # its decoded duration
    unit_audio_t: dict[int, float] = field(default_factory=dict)  # model unit -> first audio delta receipt
    unit_text_t: dict[int, float] = field(default_factory=dict)  # model unit -> first transcript delta receipt
    speak_unit: int | None = None  # `response.speak`: the unit whose decision opened the response
    cancel_t: float | None = None  # send time of our response.cancel
    done_t: float | None = None
    status: str | None = None
    stage_metrics: dict[str, Any] | None = None  # `response.done`'s duplex.stage_metrics (protocol.md §10.1)


@dataclass
class UserLog:
    index: int
    session_id: str | None = None
    opened_t: float | None = None
    commits: list[float] = field(default_factory=list)  # receipt of committed items that may get a response
    chunk_sent: list[float] = field(default_factory=list)  # send time of append k (input samples 3200k ...)
    decisions: list[tuple[int, float]] = field(default_factory=list)  # (unit, receipt of its listen/speak)
    grid: UnitGrid = field(default_factory=UnitGrid)
    responses: dict[str, ResponseLog] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    cancels_sent: int = 0
    cancel_races: int = 0  # our cancel met a response that had just ended
    max_send_lag_ms: float = 0.0
    failure: str | None = None  # why the session ended before the run did


def audio_delta_ms(ev: dict[str, Any]) -> float:
    """Decoded duration of a PCM16 delta without decoding it (base64: 3 bytes per 4 characters)."""
    b64 = ev.get("delta") or ""
    n_bytes = len(b64) * 3 // 4 - b64[-2:].count("=")
    return n_bytes / 2 / int(ev.get("sample_rate_hz") or OUTPUT_RATE) * 1000.0


def realtime_url(base: str, **query: str) -> str:
    """`ws(s)://` or `http(s)://host:port[/prefix]` -> the `/v1/realtime` WebSocket URL with `query`."""
    parts = urlsplit(base if "://" in base else f"ws://{base}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/v1/realtime", urlencode(query), ""))


def _error_code(ev: dict[str, Any]) -> tuple[str, str | None]:
    err = ev.get("error")
    if isinstance(err, dict):
        return str(err.get("code")), err.get("event_id")
    return str(ev.get("code")), ev.get("client_event_id")


FILLER = "The caller may ask about anything; answer briefly and kindly, in the caller's language. "


def long_instructions(chars: int) -> str:
    """`chars` characters of system prompt (repeated filler): a session whose context starts that deep, as a long
    call's does, so a load test runs its attention at the serving context rather than near zero (the tiny and
    the full-size dummy checkpoints' tokenizer is byte level: about one position per character)."""
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def session_config(instructions: str | None = None) -> dict[str, Any]:
    """The session.update body: SESSION_CONFIG, with `instructions` when given."""
    return SESSION_CONFIG if instructions is None else {**SESSION_CONFIG, "instructions": instructions}


class User:
    def __init__(self, index: int, url: str, speech: list[np.ndarray], duration_s: float, *,
                 cancel_every_s: float | None = None, api_key: str | None = None,
                 plan: dict[str, int] | None = None, clock: Callable[[], float] = time.monotonic,
                 unit_align_s: float = 0.0, unit_align_min_sessions: int = 0,
                 live_sessions: Callable[[], int] | None = None, instructions: str | None = None) -> None:
        self.url, self.speech, self.duration_s, self.plan = url, speech, duration_s, plan
        self.instructions = instructions
        self.unit_align_s = unit_align_s  # the gateway's DUPLEX_UNIT_ALIGN_S: its grid after a commit
        # the gateway aligns only while this many sessions are live (DUPLEX_UNIT_ALIGN_MIN_SESSIONS); the load's
        # own open sessions stand for its count, which holds while the gateway serves only this load
        self.unit_align_min_sessions, self.live_sessions = unit_align_min_sessions, live_sessions
        self.live = False  # session.created seen and session.close not yet sent
        self._t0: float | None = None  # the send schedule's start: chunk k is due at t0 + k x APPEND_S
        self.cancel_every_s, self.api_key, self.clock = cancel_every_s, api_key, clock
        self.log = UserLog(index)
        self._ws: websockets.ClientConnection | None = None
        self._active: str | None = None  # the non-terminal response
        self._player_end = 0.0  # when the simulated 1x player runs dry (client clock)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def run(self) -> UserLog:
        try:
            await self._open()
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
            self.log.failure = f"open failed: {type(exc).__name__}: {exc}"
            self.log.errors["connect_failed"] += 1
            return self.log
        if self.log.failure is not None:
            return self.log
        receiver = asyncio.create_task(self._receive())
        cancels = asyncio.create_task(self._cancel_loop()) if self.cancel_every_s else None
        try:
            await self._send_audio(receiver)
        except ConnectionClosed:
            pass  # the receiver records why
        finally:
            if cancels is not None:
                cancels.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await cancels
        await self._close(receiver)
        return self.log

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._ws = await websockets.connect(realtime_url(self.url, autostart="0"),
                                            max_size=MAX_MESSAGE_BYTES, open_timeout=OPEN_TIMEOUT_S,
                                            additional_headers=headers)
        await self._ws.send(json.dumps({"type": "session.update", "session": session_config(self.instructions)}))
        first = json.loads(await asyncio.wait_for(self._ws.recv(), OPEN_TIMEOUT_S))
        if first.get("type") != "session.created":
            code, _ = _error_code(first)
            self.log.errors[code] += 1
            self.log.failure = f"open refused: {code}"
            await self._ws.close()
            return
        self.log.session_id = (first.get("session") or {}).get("id")
        self.log.opened_t = self.clock()
        self.live = True

    async def _close(self, receiver: asyncio.Task[None]) -> None:
        assert self._ws is not None
        self.live = False
        with contextlib.suppress(ConnectionClosed):
            await self._ws.send(json.dumps({"type": "session.close"}))
        try:
            await asyncio.wait_for(asyncio.shield(receiver), CLOSE_TIMEOUT_S)
        except TimeoutError:
            self.log.errors["close_timeout"] += 1
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver
        with contextlib.suppress(ConnectionClosed):
            await self._ws.close()

    # -- input ---------------------------------------------------------------------------------------
    async def _send_audio(self, receiver: asyncio.Task[None]) -> None:
        assert self._ws is not None
        t0 = self._t0 = self.clock()
        for k, chunk in enumerate(self._chunks()):
            target = t0 + k * APPEND_S
            if target - t0 >= self.duration_s or receiver.done():
                return
            delay = target - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            lag_s = self.clock() - target
            self.log.max_send_lag_ms = max(self.log.max_send_lag_ms, lag_s * 1000.0)
            if lag_s > MAX_LAG_S:
                self.log.grid.lose_at(k * APPEND_SAMPLES)
            self.log.chunk_sent.append(self.clock())
            await self._ws.send(json.dumps({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(chunk.astype("<i2").tobytes()).decode()}))

    def _chunks(self) -> Iterator[np.ndarray]:
        """200 ms chunks forever: a sentence, then silence until the next one is due."""
        silence = np.zeros(APPEND_SAMPLES, np.int16)
        turn, k = self.log.index, 0  # k: the next chunk's index on the input clock
        while True:
            pcm = self.speech[turn % len(self.speech)]
            if self.plan is None or self._plan_says_speak(k * APPEND_SAMPLES, len(pcm)):
                for start in range(0, len(pcm), APPEND_SAMPLES):
                    piece = pcm[start:start + APPEND_SAMPLES]
                    yield np.pad(piece, (0, APPEND_SAMPLES - len(piece)))
                    k += 1
                turn += 1
                quiet_s = 0.0
            while self.plan is None and (quiet_s < MIN_SILENCE_S or
                                         (quiet_s < MAX_SILENCE_S and not self._assistant_quiet())):
                yield silence
                quiet_s, k = quiet_s + APPEND_S, k + 1
            if self.plan is not None:
                yield silence
                k += 1

    def _plan_says_speak(self, pos: int, length: int) -> bool:
        """Start the sentence now if then its commit lands `COMMIT_INTO_UNIT_S` into the first speak unit of
        the plan's next turn (and no response is active)."""
        if self._active is not None:
            return False
        unit, _ = self.log.grid.unit_at(pos)
        for v in range(unit + 1, unit + 1 + 2 * FORCE_LISTEN_UNITS + sum(self.plan.values()) + 1):
            if plan_speaks(self.plan, v, FORCE_LISTEN_UNITS) and not plan_speaks(self.plan, v - 1, FORCE_LISTEN_UNITS):
                start = self.log.grid.start(v) + int((COMMIT_INTO_UNIT_S - VAD_SILENCE_S) * INPUT_RATE) - length
                if start >= pos:
                    return start < pos + APPEND_SAMPLES and self._plan_listens(start, v)
        return False

    def _plan_listens(self, pos: int, unit: int) -> bool:
        """Whether every unit from the one holding `pos` up to `unit` (excluded) listens: speech there never
        overlaps a scripted turn. A plan with too few listen units for a sentence gets no user turns."""
        first, _ = self.log.grid.unit_at(max(pos, 0))
        return not any(plan_speaks(self.plan, u, FORCE_LISTEN_UNITS) for u in range(first, unit))

    def _assistant_quiet(self) -> bool:
        return self._active is None and self.clock() >= self._player_end

    # -- barge-in ------------------------------------------------------------------------------------
    async def _cancel_loop(self) -> None:
        assert self._ws is not None and self.cancel_every_s
        due = self.clock() + self.cancel_every_s
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            resp = self.log.responses.get(self._active) if self._active else None
            if self.clock() < due or resp is None or not resp.audio_t or resp.cancel_t is not None:
                continue
            resp.cancel_t = self.clock()
            self.log.cancels_sent += 1
            try:
                await self._ws.send(json.dumps({"type": "response.cancel", "response_id": resp.response_id,
                                                "event_id": f"{CANCEL_ID}{self.log.cancels_sent}"}))
            except ConnectionClosed:
                return  # the receiver records why
            due = self.clock() + self.cancel_every_s

    # -- output --------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                t = self.clock()
                ev = json.loads(raw)
                if self._on_event(ev, t):
                    return
        except ConnectionClosed as exc:
            self.log.failure = f"socket closed without session.closed: {exc}"
            self.log.errors["socket_closed"] += 1
            return
        self.log.failure = "socket closed without session.closed"
        self.log.errors["socket_closed"] += 1

    def _on_event(self, ev: dict[str, Any], t: float) -> bool:
        """Record one server event; True at the session's terminal event."""
        kind = ev.get("type")
        resp = self.log.responses.get(ev.get("response_id") or "")
        if kind == "response.output_audio.delta" and resp is not None:
            dur = audio_delta_ms(ev)
            resp.audio_t.append(t)
            resp.audio_ms.append(dur)
            resp.unit_audio_t.setdefault(_unit(ev), t)
            self._player_end = max(self._player_end, t) + dur / 1000.0
        elif kind == "response.output_audio_transcript.delta" and resp is not None:
            resp.unit_text_t.setdefault(_unit(ev), t)
        elif kind in ("response.speak", "response.listen"):
            unit = ev.get("model_unit_index")
            if unit is not None:
                self.log.decisions.append((int(unit), t))
                if resp is not None and resp.speak_unit is None:
                    resp.speak_unit = int(unit)
        elif kind == "response.created":
            rid = ev["response"]["id"]
            self.log.responses[rid] = ResponseLog(rid, t)
            self._active = rid
        elif kind == "response.done":
            rid = ev["response"]["id"]
            if rid in self.log.responses:
                done = self.log.responses[rid]
                done.done_t, done.status = t, ev["response"].get("status")
                done.stage_metrics = (ev["response"].get("duplex") or {}).get("stage_metrics")
            if self._active == rid:
                self._active = None
        elif kind == "input_audio_buffer.committed":
            self._on_commit(ev.get("metadata") or {}, t)
        elif kind == "output_audio_buffer.cleared":
            self._player_end = t  # the client stops playback at once (§8.4 B5)
        elif kind == "error":
            self._on_error(ev)
        return kind in ("session.closed", "session.expired")

    def _on_commit(self, md: dict[str, Any], t: float) -> None:
        """Record a commit and move the unit grid: a final append restarts it at the commit's position."""
        pos = int(md.get("audio_end_ms") or 0) * INPUT_RATE // 1000
        if not md.get("no_response"):
            self.log.commits.append(t)
        if md.get("reason") == "committed" and not md.get("response_create_deferred"):
            self.log.grid.flush_at(pos)
            if self._aligning():
                self._align_after(pos, t)
        elif md.get("reason") != "short_overlap_ack":  # padded later (deferred) or dropped: position unknown
            self.log.grid.lose_at(pos)

    def _aligning(self) -> bool:
        """Whether the gateway puts the unit after this commit on its tick (gateway/session/units.py)."""
        floor_met = self.live_sessions is None or self.live_sessions() >= self.unit_align_min_sessions
        return self.unit_align_s > 0 and floor_met

    def _align_after(self, pos: int, t: float) -> None:
        """The gateway cuts the unit after a commit short on the next tick of its clock (time.monotonic, this
        host's too), at the input sample the tick falls on by the arrival of the chunk that passes it: a chunk is
        sent at the start of its 200 ms (t0 + k x APPEND_S) and the gateway takes its audio as ending on arrival."""
        k = pos // APPEND_SAMPLES - 1  # the append whose audio ended at the commit, sent about when it was made
        at = self.log.chunk_sent[k] if 0 <= k < len(self.log.chunk_sent) else t
        tick = (at // self.unit_align_s + 1) * self.unit_align_s
        cut = APPEND_SAMPLES + round((tick - self._t0) * INPUT_RATE) if self._t0 is not None else pos
        if cut > pos:  # else the tick came with the commit's own chunk: the grid already restarts at the commit
            self.log.grid.flush_at(cut)  # the gateway's short unit ends there, as a commit's does

    def _on_error(self, ev: dict[str, Any]) -> None:
        code, event_id = _error_code(ev)
        if code == "response_not_active" and str(event_id or "").startswith(CANCEL_ID):
            self.log.cancel_races += 1
        else:
            self.log.errors[code] += 1


def _unit(ev: dict[str, Any]) -> int:
    unit = (ev.get("metadata") or {}).get("model_unit_index")
    return -1 if unit is None else int(unit)
