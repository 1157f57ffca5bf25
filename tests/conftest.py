"""Shared fixtures.

One Prefect test harness per test session (starting a Prefect API costs seconds), used by every
flow and CLI test; engine tests never touch Prefect.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path

import dask
import pytest

from dlrmflow.engine.serving.cluster import WORKER_START, housekeeping_environment, start_worker_server

DATA = Path(__file__).parent / "data"

# Every Dask process of the tests (their own LocalClusters, the external and emulated hosts' workers, this
# process's schedulers) does Dask's periodic housekeeping as rarely as the clusters dlrmflow starts do: with
# Dask's defaults an idle worker costs about 4% of a core, and so does a scheduler (benchmarks/idle_cluster.py),
# while the suite's clusters wait between and within their tests on CI's 2 cores (tests/test_hosts.py's seven
# hosts alone: 13 processes).
os.environ.update(housekeeping_environment())
dask.config.refresh()


@pytest.fixture(scope="session", autouse=True)
def forked_dask_workers() -> Iterator[None]:
    """The tests' own LocalClusters start their workers as dlrmflow's do: forked from this process's one server
    that imported torch and the engine (engine/serving/cluster.py), with its environment. Spawned, each of the
    suite's 40-odd such workers imported them anew: about 3 CPU seconds each, 136 in all (measured on 2 cores).
    With what a trainer imports (``trainers=True``): the suite's many trainer and scoring workers then do not
    import torch's compiler after each fork (about 10% less CPU over its data-parallel and scoring modules)."""
    start_worker_server(trainers=True)
    with dask.config.set({"distributed.worker.multiprocessing-method": WORKER_START}):
        yield


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """Prefect's test harness: a server of this process's own on a fresh SQLite database; its schema comes from
    a copy of the first harness's database (:func:`migrated_database`)."""
    from prefect.testing import utilities

    made: list[str] = []
    with ExitStack() as harness, migrated_database(tmp_path_factory) as (template, take_snapshot):
        def temporary_dir_with_database() -> str:  # where prefect_test_harness puts its database
            made.append(tempfile.mkdtemp())
            if template is not None:
                shutil.copyfile(template, Path(made[-1]) / "prefect-test.db")
            return made[-1]

        real, utilities.mkdtemp = utilities.mkdtemp, temporary_dir_with_database
        try:
            harness.enter_context(utilities.prefect_test_harness(server_startup_timeout=120))
        finally:
            utilities.mkdtemp = real
        take_snapshot(Path(made[0]) / "prefect-test.db")
        started = harness.pop_all()
    with started:
        yield


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """``prefect server start`` with a PREFECT_HOME of its own, as the README's deployment block starts it
    (tests/prefect_deployments.py); one per test module."""
    from prefect_deployments import running_server

    base = tmp_path_factory.mktemp("prefect-server")
    with ExitStack() as server, migrated_database(tmp_path_factory) as (template, take_snapshot):
        made = server.enter_context(running_server(base, database=template))
        take_snapshot(made.database)
        started = server.pop_all()
    with started:
        yield made


@pytest.fixture(scope="module")
def prefect_worker(prefect_server):
    """The README's work pool, deployments and process worker on ``prefect_server``; the worker's log."""
    from prefect_deployments import polling_worker

    with polling_worker(prefect_server) as log:
        yield log


@contextmanager
def migrated_database(tmp_path_factory) -> Iterator[tuple[Path | None, Callable[[Path], None]]]:
    """A Prefect server's start migrates a fresh database through every schema revision: most of its 15-20 CPU
    seconds. The test run's first server (of any pytest-xdist worker) starts on an empty database and leaves a
    copy of it, migrated, for the next ones: yields (that copy, or None and a lock that the other workers wait on
    meanwhile; a function that makes the copy from a database path)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    template = shared / "prefect-migrated.db"

    def take_snapshot(database: Path) -> None:
        if template.exists():
            return
        partial = template.with_suffix(".partial")
        with closing(sqlite3.connect(database)) as source, closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)  # consistent while the server writes
        partial.rename(template)

    with open(shared / "prefect-migrated.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if template.exists():
            fcntl.flock(lock, fcntl.LOCK_UN)  # only the first server's start is waited for
            yield template, take_snapshot
        else:
            yield None, take_snapshot


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


# Fixtures that start servers or processes: Dask worker processes (a LocalCluster of processes, or
# external workers) and the Prefect API. The tests that use them are end-to-end, so they count as slow:
# `make test-fast` runs the rest (algorithms, formats, in-process clusters) in under three minutes (160 s on 2 cores).
END_TO_END_FIXTURES = {"cluster", "clusters", "external_cluster", "prefect_harness", "prefect_server"}


# The modules that take longest (minutes each, most of it in one end-to-end test), longest first. In a
# parallel run (`make test`: pytest-xdist, --dist loadfile --no-loadscope-reorder) the workers take whole
# modules in collection order, so these go first: started last, one of them alone would be the run's tail.
# Out of date, this list costs only time (`pytest --durations=30` shows the slowest tests).
LONGEST_MODULES = ["test_hosts.py", "test_prefect_server.py", "test_readme.py", "test_recovery.py", "test_pipeline.py",
                   "test_external_dask.py", "test_data_parallel.py", "test_preprocess.py", "test_planner.py",
                   "test_models.py", "test_fast_start.py", "test_resume.py", "test_dataset_cli.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if END_TO_END_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a serial run keeps pytest's own order
        def rank(item: pytest.Item) -> int:
            name = item.path.name
            return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

        items.sort(key=rank)  # stable: each module's tests keep their order
