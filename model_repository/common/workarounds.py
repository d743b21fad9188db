"""Workarounds for defects of the Python-backend stub bundled with Triton 2.51 (nvidia-pytriton 0.7.0).

Each is applied from `initialize` (never at import) and says what it guards against.
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys

import numpy as np

# Extra references given to numpy's object dtype; far more than a server lifetime can drop.
OBJECT_DTYPE_PIN_REFS = 1 << 40


def pin_object_dtype() -> None:
    """NOTE: under sequences that end early or overlap, the stub drops references to numpy's object
    dtype (BYTES tensors) that it never took. The object dtype then reaches refcount 0 and the stub
    dies with "*** Reference count error detected: an attempt was made to deallocate the dtype 17 (O)"
    or heap corruption ("corrupted size vs. prev_size"). Pinning the singleton keeps it alive.
    """
    dtype = np.dtype(np.object_)
    if sys.getrefcount(dtype) < OBJECT_DTYPE_PIN_REFS:
        ctypes.c_ssize_t.from_address(id(dtype)).value += OBJECT_DTYPE_PIN_REFS


def report_fatal_signals() -> None:
    """A stub that dies on SIGSEGV/SIGABRT otherwise leaves only "Stub process ... is not healthy";
    faulthandler writes every thread's Python stack to stderr (the tritonserver log) first."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
