import pytest

# Gateway tests are small and real-time bounded: fail fast instead of hanging on a lost event.
GATEWAY_TEST_TIMEOUT_S = 30


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gateway" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GATEWAY_TEST_TIMEOUT_S))
