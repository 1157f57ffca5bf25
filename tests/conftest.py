"""Shared fixtures.

One Prefect test harness per test session (starting a Prefect API costs seconds), used by every
flow and CLI test; engine tests never touch Prefect.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


# Fixtures that start servers or processes: Dask worker processes (a LocalCluster of processes, or
# external workers) and the Prefect API. The tests that use them are end-to-end, so they count as slow:
# `make test-fast` runs the rest (algorithms, formats, in-process clusters) in under two minutes.
END_TO_END_FIXTURES = {"cluster", "clusters", "external_cluster", "prefect_harness"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if END_TO_END_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
