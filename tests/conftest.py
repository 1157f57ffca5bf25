"""Shared fixtures.

One Prefect test harness per test session (starting a Prefect API costs seconds), used by every
flow and CLI test; engine tests never touch Prefect.
"""

from __future__ import annotations

import os
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


# The modules that take longest (minutes each, most of it in one end-to-end test), longest first. In a
# parallel run (`make test`: pytest-xdist, --dist loadfile --no-loadscope-reorder) the workers take whole
# modules in collection order, so these go first: started last, one of them alone would be the run's tail.
# Out of date, this list costs only time (`pytest --durations=30` shows the slowest tests).
LONGEST_MODULES = ["test_prefect_server.py", "test_readme.py", "test_pipeline.py",
                   "test_fast_start.py", "test_recovery.py", "test_external_dask.py", "test_dataset_cli.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if END_TO_END_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a serial run keeps pytest's own order
        def rank(item: pytest.Item) -> int:
            name = item.path.name
            return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

        items.sort(key=rank)  # stable: each module's tests keep their order
