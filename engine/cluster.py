"""Where Dask work runs: a LocalCluster by default, or an existing scheduler.

The address comes from the caller (``--dask-address``/flow parameter) or the environment
variable ``DLRMFLOW_DASK_ADDRESS``. A LocalCluster is sized for the machine: one
single-threaded worker process per core (at most 4), because the heavy steps (Arrow parsing,
NumPy) hold one core each and processes avoid GIL contention.

Flows hold one cluster for their whole run (:func:`dask_scheduler`) and hand its address to
their tasks, which connect with :func:`dask_client`; so a pipeline starts one LocalCluster,
not one per step.

Clients talk to workers directly (``direct_to_workers``): every embedding-server call is an
actor call, and through the scheduler it would take two extra hops (and, with a LocalCluster,
the trainer process's event loop) per call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from distributed import Client, LocalCluster

ADDRESS_ENV = "DLRMFLOW_DASK_ADDRESS"


def resolve_address(address: str | None) -> str | None:
    return address or os.environ.get(ADDRESS_ENV) or None


def local_cluster(n_workers: int | None = None, memory_limit: str = "auto") -> LocalCluster:
    workers = n_workers or max(1, min(os.cpu_count() or 1, 4))
    # The scheduler lives in this process; its INFO chatter (workers joining and leaving) would
    # drown the flow's own progress lines in the terminal and the Prefect logs.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    return LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",  # a free port: never collides with another cluster's 8787
        memory_limit=memory_limit,
        silence_logs=logging.ERROR,
    )


@contextmanager
def dask_scheduler(address: str | None = None, *, n_workers: int | None = None) -> Iterator[str]:
    """Yield a scheduler address: ``address`` (or $DLRMFLOW_DASK_ADDRESS), else a new LocalCluster's."""
    address = resolve_address(address)
    if address:
        yield address
        return
    with local_cluster(n_workers) as cluster:
        yield cluster.scheduler_address


@contextmanager
def dask_client(address: str | None = None, *, n_workers: int | None = None) -> Iterator[Client]:
    """Yield a Client connected to ``address`` (or $DLRMFLOW_DASK_ADDRESS), else to a new LocalCluster."""
    address = resolve_address(address)
    if not address:
        with local_cluster(n_workers) as cluster, Client(cluster, direct_to_workers=True) as client:
            yield client
        return
    try:
        client = Client(address, timeout="20s", direct_to_workers=True)
    except OSError as exc:
        from dlrmflow.errors import UserInputError

        raise UserInputError(f"cannot reach the Dask scheduler at {address!r}: {exc}") from exc
    with client:
        yield client


def cluster_workers(client: Client) -> dict[str, dict]:
    """The scheduler's info on every worker, keyed by address (as ``client.scheduler_info()["workers"]``).

    Asked of the scheduler each time, not read from the client's cached identity: the client's
    own periodic refresh stores an identity without workers (``n_workers=0``), and when it lands
    between ``scheduler_info()``'s fetch and its return, the cluster looks empty (seen here:
    "no workers to host embedding servers" on a cluster with five)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
