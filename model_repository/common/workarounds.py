"""Workarounds for defects of the Python-backend stub bundled with Triton 2.51 (nvidia-pytriton 0.7.0).

Each is applied from `initialize` (never at import) and says what it guards against.
"""

from __future__ import annotations

import collections
import ctypes
import faulthandler
import locale
import sys
import time
from typing import Any

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


UTF8_LOCALES = ("", "C.UTF-8", "en_US.UTF-8")  # "": the environment's (LANG / LC_ALL), when it names a UTF-8 one


def utf8_text_files() -> str:
    """NOTE: the stub's embedded interpreter starts in the C locale whatever LANG says (no locale coercion,
    and PYTHONUTF8 is not read), so `open()` without an encoding reads ASCII. torch.compile's inductor reads
    its templates that way, and some hold UTF-8 (torch 2.13's mm_grouped): any compiled option then failed
    the model's load with a UnicodeDecodeError. Switch LC_CTYPE to a UTF-8 locale (from `initialize`, before
    any engine thread). Returns the codeset in effect afterwards."""
    for name in UTF8_LOCALES:
        if _codeset() == "UTF-8":
            break
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
    return _codeset()


def _codeset() -> str:
    return locale.nl_langinfo(locale.CODESET).upper().replace("UTF8", "UTF-8")


# How long a finished BLS call's Python objects are kept (see Graveyard); the stub's cleanup of a call
# takes milliseconds, so this is a wide margin. Bounded too, for a stub that idles between sweeps.
GRAVEYARD_HOLD_S = 5.0
GRAVEYARD_MAX = 4096
GRAVEYARD_SETTLE_S = 0.5  # at unload: age of the newest call before everything is released


class Graveyard:
    """Keeps a finished decoupled BLS call's response iterator and responses alive for a while.

    NOTE: when the iterator finishes, the 2.51 stub queues a cleanup that erases its own reference to the
    iterator on the stub-to-parent thread. If Python let go first, that erase is the last reference: the
    iterator, its responses and their numpy arrays are destroyed on that thread WITHOUT the GIL, racing
    the execute thread (segfaults in unrelated Python code, e.g. `json.dumps`). Holding Python references
    past the cleanup makes the last release happen here, on the execute thread, under the GIL.
    """

    def __init__(self, hold_s: float = GRAVEYARD_HOLD_S, max_items: int = GRAVEYARD_MAX) -> None:
        self.hold_s, self.max_items = hold_s, max_items
        self._items: collections.deque[tuple[float, Any]] = collections.deque()

    def keep(self, *objects: Any) -> None:
        self._items.append((time.monotonic(), objects))
        self.sweep()

    def sweep(self) -> None:
        now = time.monotonic()
        while self._items and (now - self._items[0][0] > self.hold_s or len(self._items) > self.max_items):
            self._items.popleft()

    def release_all(self, settle_s: float = GRAVEYARD_SETTLE_S) -> None:
        """At `finalize`: let the last calls' cleanups land, then release everything while the stub is
        still whole (objects left for interpreter exit segfaulted every duplex stub at unload)."""
        if self._items:
            time.sleep(max(0.0, settle_s - (time.monotonic() - self._items[-1][0])))
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
