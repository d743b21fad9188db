"""Suite-wide hygiene: the Python backend's /dev/shm regions that this test session leaves behind.

Several tests kill a tritonserver or its backend stubs on purpose (crash, restart and soak checks); a killed
server cannot unlink its 64 MiB regions, and outside the launcher (which removes its own, serve/tritonserver.py)
nobody else does: a full run left about 60 of them (4 GB of /dev/shm) on a developer machine. At the end of the
session, regions that appeared during it and that no live process maps are removed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from serve.tritonserver import SHM_DIR, SHM_PREFIX, mapped_shm_regions


def _regions() -> set[str]:
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def _mapped() -> set[str]:
    return set().union(*(mapped_shm_regions(int(p)) for p in os.listdir("/proc") if p.isdigit()))


@pytest.fixture(scope="session", autouse=True)
def _shm_regions_left_by_the_session() -> Iterator[None]:
    before = _regions()
    yield
    for name in _regions() - before - _mapped():
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            pass
