"""Fixtures the scale-out tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis

from tests.scaleout.cluster import Cluster


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of the test module's own (tests/scaleout/cluster.py), nothing persisted."""
    cluster = Cluster(Path(tmp_path_factory.mktemp("redis")))
    try:
        yield cluster.start_redis().url
    finally:
        cluster.stop()


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[redis.Redis]:
    """A plain client of the module's redis-server, emptied first."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    await r.flushdb()
    yield r
    await r.aclose()
