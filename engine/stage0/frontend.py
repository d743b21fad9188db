"""The seam between Stage0 and its encoders: audio (and optional camera frames) → LLM embeddings.

The real implementation is the streaming Whisper front end (model.md §2); tests fabricate embeddings.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class UnitFrontEnd(Protocol):
    def new_state(self) -> Any:
        """Per-session streaming state (mel buffer, audio KV)."""

    def encode_unit(self, state: Any, pcm: torch.Tensor, unit_index: int) -> torch.Tensor:
        """One unit of client PCM [samples] → exactly `audio_embeddings_per_unit` embeddings [10, H]."""

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        """Reference audio for the system prefix (§2.6) → [N, H]."""

    def encode_frame(self, frame: Any) -> torch.Tensor:
        """One camera frame → `frame_embeddings` embeddings [64, H]."""


class AudioFrontEndAdapter:
    """Adapts `engine.audio.frontend.AudioFrontEnd` (and an optional frame encoder) to `UnitFrontEnd`.

    The audio front end tracks the unit index itself (its mel stream adds the 560-sample zero prefix).
    """

    def __init__(self, audio: Any, encode_frame: Any | None = None) -> None:
        self.audio = audio
        if encode_frame is not None:
            self.encode_frame = encode_frame

    def new_state(self) -> Any:
        return self.audio.new_session()

    def encode_unit(self, state: Any, pcm: torch.Tensor, unit_index: int) -> torch.Tensor:
        # NOTE: units dropped by a cancel never reach the mel stream, so its unit count may trail
        # `unit_index`; the stream stays contiguous in what the model actually heard.
        return self.audio.encode_unit(state, pcm.to(torch.float32))

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        return self.audio.encode_reference(pcm)
