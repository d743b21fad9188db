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
        """One camera frame → `frame_embeddings` embeddings [64, H]. Optional, like the two below: a front
        end without any frame method refuses frames."""

    # Optional: `encode_units(states, pcms) -> [10, H] each` encodes many sessions' units in one batch.
    # Optional: `prepare_frame(data) -> frame` turns the wire bytes into what the encoder takes (at append,
    # ValueError for a bad image); `encode_frames(frames) -> [64, H] each` encodes many frames in one batch.


class VisionFrames:
    """The camera path of the real front end: Pillow decode/resize (`engine.model.frames`), then SigLIP and
    the resampler over every frame of a step in one batch per frame size."""

    def __init__(self, tower: Any, resampler: Any) -> None:
        self.tower, self.resampler = tower, resampler
        self.patch = tower.cfg.patch_size

    def prepare_frame(self, data: bytes | torch.Tensor) -> torch.Tensor:
        """JPEG/PNG bytes -> uint8 [H, W, 3] at the slice size; a frame prepared before (a tensor) as it is."""
        if isinstance(data, torch.Tensor):
            return data
        from engine.model.frames import decode_frame  # Pillow only where frames are served

        return decode_frame(bytes(data), self.patch)

    def encode_frames(self, frames: list[torch.Tensor]) -> list[torch.Tensor]:
        from engine.model.vision import encode_frames

        return encode_frames(self.tower, self.resampler, frames)


class AudioFrontEndAdapter:
    """Adapts `engine.audio.frontend.AudioFrontEnd` (and the optional camera path) to `UnitFrontEnd`.

    The audio front end tracks the unit index itself (its mel stream adds the 560-sample zero prefix).
    """

    def __init__(self, audio: Any, vision: VisionFrames | None = None) -> None:
        self.audio = audio
        if vision is not None:
            self.prepare_frame = vision.prepare_frame
            self.encode_frames = vision.encode_frames

    def new_state(self) -> Any:
        return self.audio.new_session()

    def encode_units(self, states: list[Any], pcms: list[torch.Tensor]) -> list[torch.Tensor]:
        """`encode_unit` of many sessions in one batch (one log-mel STFT, one encoder pass)."""
        return self.audio.encode_units(states, [p.to(torch.float32) for p in pcms])

    def encode_unit(self, state: Any, pcm: torch.Tensor, unit_index: int) -> torch.Tensor:
        # NOTE: units dropped by a cancel never reach the mel stream, so its unit count may trail
        # `unit_index`; the stream stays contiguous in what the model actually heard.
        return self.audio.encode_unit(state, pcm.to(torch.float32))

    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        return self.audio.encode_reference(pcm)
