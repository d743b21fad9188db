from __future__ import annotations

import pytest

OPS_TEST_TIMEOUT_S = 30  # unit tests of small modules: fail fast instead of hanging


class FakeClock:
    """An injectable monotonic clock that only moves when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "gateway_ops" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(OPS_TEST_TIMEOUT_S))
