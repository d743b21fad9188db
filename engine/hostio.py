"""Host ↔ device copies for the engines' step paths (STYLE.md practice 4: no host syncs but the id read-back).

A copy from pageable host memory is synchronous with the device stream, so small step inputs go through
pinned memory (the caching host allocator makes that cheap after warm-up) with a non-blocking copy, and
the one result the host needs each step (the sampled ids) comes back with a non-blocking copy behind an
event.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor → device without blocking the host on a CUDA device; a no-op copy elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":  # device to device is asynchronous already
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def read_back(t: torch.Tensor) -> list:
    """Device tensor → nested Python lists: one non-blocking copy, then wait on an event for it alone."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
