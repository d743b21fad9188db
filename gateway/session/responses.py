"""Response state and the canonical events of its lifecycle (protocol.md §3.2, §3.4 R1-R8).

`Response` is private to the session; the builders here turn it into `ga` event dicts and never
change it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import server_events as se
from gateway.protocol.config import ResponseOptions  # validated at the wire (config.response_options)
from gateway.session.metrics import StageMetrics
from gateway.session.playback import PlaybackEntry

Json = dict[str, Any]


@dataclass(slots=True)
class Response:
    id: str
    item_id: str
    trigger: str  # model | response_create | deferred_commit
    epoch: int
    model_turn_id: int
    input_item_id: str | None
    previous_item_id: str | None
    options: ResponseOptions
    precreated: bool
    decision: str = "listen"  # becomes "speak" with the first speak decision (§3.2 duplex.decision)
    terminal: bool = False
    spoke: bool = False  # response.speak queued
    audio_deltas: int = 0  # queued (and not purged) audio deltas
    transcript: str = ""  # queued (and not purged) transcript / text
    text_tokens: int = 0
    audio_ms: int = 0  # queued response-relative audio position
    metrics: StageMetrics = field(default_factory=StageMetrics)
    playback: PlaybackEntry | None = None

    def _ref(self) -> Json:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def part(self, text: str) -> Json:
        return {"type": "text", "text": text} if self.options.text_only else {"type": "audio", "transcript": text}

    def item(self, status: str, text: str | None) -> Json:
        if text is None:
            content: list[Json] = []
        elif self.options.text_only:
            content = [{"type": "output_text", "text": text}]
        else:
            content = [{"type": "output_audio", "transcript": text}]
        return {"id": self.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def duplex(self) -> Json:
        return {"trigger": self.trigger, "epoch": self.epoch, "model_turn_id": self.model_turn_id,
                "input_item_id": self.input_item_id}

    def response_obj(self, status: str, status_details: Json | None, output: list[Json], duplex: Json) -> Json:
        text_only = self.options.text_only
        return {"id": self.id, "object": "realtime.response", "status": status, "status_details": status_details,
                "output": output, "output_modalities": ["text"] if text_only else ["audio"],
                "modalities": ["text"] if text_only else ["text", "audio"], "usage": None,
                "metadata": self.options.metadata, "duplex": duplex}

    # response.created, then the assistant item, output item and content part, before any output (R1-R2)
    def opening_events(self) -> list[Json]:
        return [
            se.ResponseCreated(response=self.response_obj("in_progress", None, [], self.duplex())).model_dump(),
            se.ItemAdded(previous_item_id=self.previous_item_id, item=self.item("in_progress", None)).model_dump(),
            se.OutputItemAdded(response_id=self.id, item=self.item("in_progress", None)).model_dump(),
            se.ContentPartAdded(**self._ref(), part=self.part("")).model_dump(),
        ]

    # the model chose speak: at most once, before the first delta (R3)
    def speak_event(self, session_id: str, unit: int | None) -> Json:
        return se.ResponseSpeak(**self._ref(), session_id=session_id, epoch=self.epoch,
                                model_turn_id=self.model_turn_id, model_unit_index=unit).model_dump()

    # one unit's output: the audio delta and its transcript delta, sent as a pair (R4, C-3)
    def pair_events(self, audio_b64: str, fmt: str, rate: int, text: str, md: Json) -> list[Json]:
        return [se.AudioDelta(**self._ref(), delta=audio_b64, format=fmt, sample_rate_hz=rate,
                              metadata=md).model_dump(),
                se.TranscriptDelta(**self._ref(), delta=text,
                                   metadata={"epoch": md["epoch"], "model_unit_index": md["model_unit_index"]}
                                   ).model_dump()]

    def transcript_delta_event(self, text: str, unit: int) -> Json:
        """A transcript delta on its own, sent as its text is generated (the pair's half follows with "")."""
        return se.TranscriptDelta(**self._ref(), delta=text,
                                  metadata={"epoch": self.epoch, "model_unit_index": unit}).model_dump()

    def text_delta_event(self, text: str, unit: int) -> Json:
        return se.TextDelta(**self._ref(), delta=text,
                            metadata={"epoch": self.epoch, "model_unit_index": unit}).model_dump()

    # the end: audio/transcript done, part and item done, response.done, rate limits (R5-R8; a cancel K3-K9;
    # a declined precreated response L4, without R5)
    def terminal_events(self, status: str, status_details: Json, item_status: str, duplex: Json) -> list[Json]:
        out: list[Json] = []
        text = self.transcript
        if self.options.text_only:
            if text:
                out.append(se.TextDone(**self._ref(), text=text).model_dump())
        else:
            if self.audio_deltas:
                out.append(se.AudioDone(**self._ref()).model_dump())
            if text:
                out.append(se.TranscriptDone(**self._ref(), transcript=text).model_dump())
        item = self.item(item_status, text)
        out.append(se.ContentPartDone(**self._ref(), part=self.part(text)).model_dump())
        out.append(se.OutputItemDone(response_id=self.id, item=item).model_dump())
        out.append(se.ItemDone(previous_item_id=self.previous_item_id, item=item).model_dump())
        resp_item = {k: v for k, v in item.items() if k != "object"}
        out.append(se.ResponseDone(response=self.response_obj(status, status_details, [resp_item], duplex)
                                   ).model_dump())
        out.append(se.RateLimitsUpdated().model_dump())
        return out
