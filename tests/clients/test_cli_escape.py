"""`duplex talk` prints a transcript with control characters escaped (issue 17): random weights say any bytes."""

from __future__ import annotations

import asyncio
import io
from typing import Any

from clients.cli import _print_live, printable
from clients.events import ResponseCreated, ResponseDone, TextDelta

RAW = "hi\x1b[2J\x07\r\u202eevil\nnext"  # clear-screen, bell, carriage return, bidi override, newline


def test_printable_escapes_controls_and_keeps_text() -> None:
    assert printable(RAW) == "hi\\x1b[2J\\x07\\r\\u202eevil\\nnext"
    assert printable("héllo, 你好 ✓") == "héllo, 你好 ✓"


class _Client:
    """The part of DuplexClient `_print_live` reads: the event history, one at a time."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    async def wait_for(self, _kind: None, since: int) -> Any:
        if since >= len(self.events):
            await asyncio.sleep(3600)
        return self.events[since]


async def test_live_transcript_has_no_raw_control_characters() -> None:
    out = io.StringIO()
    events = [ResponseCreated(response_id="r1", trigger=None, epoch=0),
              TextDelta(type="response.output_text.delta", response_id="r1", delta=RAW),
              ResponseDone(response_id="r1", status="completed", reason="\x1b]0;title\x07", transcript=RAW, duplex={})]
    task = asyncio.create_task(_print_live(_Client(events), out))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    task.cancel()
    text = out.getvalue()
    assert printable(RAW) in text and "\\x1b]0;title\\x07" in text
    assert not any(ch in text for ch in "\x1b\x07\r\u202e")
