"""What a flow phase runs on (issue 19: no import cycle): one `stream` call, and the session it belongs to.

`stream.py` plans calls and runs one session's call; `batch.py` and `pooled.py` run the flow phase of many
sessions' calls at once. Both sides meet here, so the batched flow phases need not import the session
module that uses them for its own single-session path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.token2wav.flow import FlowCache
from engine.token2wav.pool import SlotState
from engine.token2wav.voice import VoiceCache


@dataclass
class PendingCall:
    tokens: list[int]
    last: bool
    mel: torch.Tensor | None = None       # [1, 80, F] once the flow phase ran


class FlowSession(Protocol):
    """What a flow phase reads and writes of a session (stream.py's `SessionStream`)."""

    voice: VoiceCache
    slot: SlotState | None                # pooled flow caches (pool.py); None: own FlowCache tensors
    flow_cache: FlowCache | None          # None while pooled

    def trim_phase(self, cache: FlowCache) -> FlowCache: ...
