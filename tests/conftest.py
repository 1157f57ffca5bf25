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
