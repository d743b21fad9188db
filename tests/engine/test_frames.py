"""Camera frames: JPEG/PNG of any size -> the one slice of the reference processor at max_slice_nums 1, and
the batched vision encoder equals the per-frame one (model.md §1.4, protocol.md §9.4)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from engine.model.frames import best_size, decode_frame
from engine.model.vision import Resampler, SiglipVisionTower, encode_frame, encode_frames
from tests.engine.test_vision import EMBED, randomize_, tiny_vision

PATCH = 14


def image_bytes(width: int, height: int, fmt: str = "JPEG", seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format=fmt)
    return out.getvalue()


def reference_size(width: int, height: int, scale: int = 448, patch: int = PATCH) -> tuple[int, int]:
    """Transcription of the reference processor's `find_best_resize(..., allow_upscale=True)`."""
    def ensure_divide(length: int) -> int:
        return max(round(length / patch) * patch, patch)

    r = width / height
    height = int(scale / math.sqrt(r))
    width = int(height * r)
    return ensure_divide(width), ensure_divide(height)


@pytest.mark.parametrize("size,want", [((640, 480), (518, 392)), ((448, 448), (448, 448)),
                                       ((1920, 1080), (602, 336)), ((20, 10), (630, 322)), ((480, 640), (392, 518))])
def test_slice_size_is_the_reference_processors(size: tuple[int, int], want: tuple[int, int]) -> None:
    assert best_size(*size, 448, PATCH) == reference_size(*size) == want


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_decode_resizes_with_pillow_bicubic(fmt: str) -> None:
    data = image_bytes(640, 480, fmt)
    frame = decode_frame(data, PATCH)
    assert frame.dtype == torch.uint8 and tuple(frame.shape) == (392, 518, 3)
    want = Image.open(io.BytesIO(data)).convert("RGB").resize((518, 392), resample=Image.Resampling.BICUBIC)
    assert torch.equal(frame, torch.from_numpy(np.array(want)))


@pytest.mark.parametrize("data", [b"not an image", image_bytes(32, 32, "GIF"), image_bytes(32, 32, "BMP"),
                                  image_bytes(640, 480)[:200]])
def test_a_bad_frame_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_frame(data, PATCH)


def test_batched_encoder_equals_one_frame_at_a_time() -> None:
    cfg = tiny_vision()
    tower, res = randomize_(SiglipVisionTower(cfg), seed=6), randomize_(Resampler(cfg, EMBED), seed=7)
    g = torch.Generator().manual_seed(8)
    frames = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
              for shape in ((28, 42, 3), (56, 28, 3), (28, 42, 3))]  # two sizes: two batches
    batched = encode_frames(tower, res, frames)
    for frame, out in zip(frames, batched, strict=True):
        torch.testing.assert_close(out, encode_frame(tower, res, frame), atol=1e-5, rtol=1e-5)
