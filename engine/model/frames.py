"""Camera frames: JPEG/PNG bytes -> the RGB pixels the vision tower takes (model.md §1.4, protocol.md §9.4).

The reference image processor at `max_slice_nums = 1` never slices a frame: it resizes the whole image
with `find_best_resize(..., allow_upscale=True)`, i.e. to the area of `scale_resolution`² with the aspect
ratio kept, then rounds each side to a multiple of the patch size, with bicubic resampling of the RGB
image (640x480 -> 518x392, 448x448 -> 448x448). Pillow does the decoding and the resampling.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

SCALE_RESOLUTION = 448  # preprocessor_config.json `scale_resolution`
FORMATS = ("JPEG", "PNG")  # a frame is a bare-base64 JPEG or PNG image (protocol.md §9.4 V-1)
MAX_SOURCE_PIXELS = 4096 * 4096  # refuse larger images before decoding them (a decompression bomb)


def best_size(width: int, height: int, scale_resolution: int, patch: int) -> tuple[int, int]:
    """(width, height) of the one slice, as the reference's `find_best_resize` with upscaling allowed."""
    ratio = width / height
    h = int(scale_resolution / math.sqrt(ratio))
    w = int(h * ratio)
    return _patch_multiple(w, patch), _patch_multiple(h, patch)


def _patch_multiple(length: float, patch: int) -> int:
    return max(round(length / patch) * patch, patch)  # Python's round, as the reference


def decode_frame(data: bytes, patch: int, scale_resolution: int = SCALE_RESOLUTION) -> torch.Tensor:
    """One JPEG/PNG -> uint8 [H, W, 3] at the slice size. ValueError names what is wrong with it."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in FORMATS:
                raise ValueError(f"frame format {img.format} is not JPEG or PNG")
            if img.width * img.height > MAX_SOURCE_PIXELS:
                raise ValueError(f"frame of {img.width}x{img.height} pixels is too large")
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"frame is not a decodable image: {exc}") from None
    resized = rgb.resize(best_size(rgb.width, rgb.height, scale_resolution, patch),
                         resample=Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())  # [H, W, 3]
