"""Where Dask work runs: a LocalCluster by default, or an existing scheduler.

The address comes from the caller (``--dask-address``/flow parameter) or the environment
variable ``DLRMFLOW_DASK_ADDRESS``. A LocalCluster is sized for the machine: one
single-threaded worker process per core (at most ``max_workers``), because the heavy steps
(Arrow parsing, NumPy) hold one core each and processes avoid GIL contention.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from distributed import Client, LocalCluster

ADDRESS_ENV = "DLRMFLOW_DASK_ADDRESS"


def resolve_address(address: str | None) -> str | None:
    return address or os.environ.get(ADDRESS_ENV) or None


@contextmanager
def dask_client(
    address: str | None = None,
    *,
    n_workers: int | None = None,
    memory_limit: str = "auto",
) -> Iterator[Client]:
    """Yield a Client: connected to ``address`` (or $DLRMFLOW_DASK_ADDRESS), else a LocalCluster."""
    address = resolve_address(address)
    if address:
        try:
            client = Client(address, timeout="20s")
        except OSError as exc:
            raise ConnectionError(f"cannot reach the Dask scheduler at {address!r}: {exc}") from exc
        with client:
            yield client
        return
    workers = n_workers or max(1, min(os.cpu_count() or 1, 4))
    with LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        memory_limit=memory_limit,
        silence_logs="error",
    ) as cluster, Client(cluster) as client:
        yield client
