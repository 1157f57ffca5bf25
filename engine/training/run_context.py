"""What a training run is given from outside the engine: the Dask client and the caller's callbacks.

The entry point (:func:`~dlrmflow.engine.training.job.train`, which the CLI's flow, the tests and the
benchmarks call) makes one :class:`RunContext` from its keyword arguments; the layers below pass it on
whole, each reading only its own parts, so that adding one means no new parameter down the chain.

A trainer on a Dask worker (a run of W > 1 trainers) gets a context of its own, made there
(:meth:`RunContext.on_worker`): the driver's client belongs to the driver's event loop and its
callbacks close over the driver's state (a Prefect flow run's context, a progress bar), so none of it is
pickled into the trainers' tasks. The driver keeps them: it relays trainer 0's progress to its callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlrmflow.engine.coding.group import RecoveryRunner

if TYPE_CHECKING:
    from distributed import Client

Progress = Callable[[int, int], None]
MetricsCallback = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class RunContext:
    """The run's Dask client and callbacks; every field may be None.

    ``client``: the Dask client the run's servers, trainers, kills and checkpoints go through. The
    driver's (the caller's) in the driver: :func:`~.launch.run_trainers` places and watches W trainers
    through it and hands it to a trainer in its process; in a trainer on a Dask worker, that worker's
    client. :func:`~.trainer.train_rank` (trainer 0) starts the embedding servers, injects kills and
    takes checkpoints through it. None when the caller has no cluster: one trainer of a mode without
    servers.

    ``progress``: ``progress(done, iterations)`` as trainer 0's iterations are done. Called in the driver
    only, by :func:`~.launch.run_trainers` (from trainer 0's reports); None on a worker, and when the
    caller shows no progress.

    ``on_metrics``: ``on_metrics(row)`` with each of trainer 0's metrics rows (means over
    ``metrics_every`` iterations). Called in the driver only, as ``progress``; None on a worker, and when
    the caller takes no rows.

    ``recovery_runner``: ``recovery_runner(rebuild, info)`` runs each shard rebuild of a coded group
    (the train flow wraps it in a Prefect subflow, a child of the flow run). Trainer 0 hands it to its
    coded shard group (:func:`~.trainer.start_servers`), whose recovery thread calls it. None without
    parity, outside a flow (a rebuild then runs plainly), and on a worker: the subflow belongs to the
    driver's flow run."""

    client: Client | None = None
    progress: Progress | None = None
    on_metrics: MetricsCallback | None = None
    recovery_runner: RecoveryRunner | None = None

    @classmethod
    def on_worker(cls, client: Client) -> RunContext:
        """A trainer's context on a Dask worker: ``client`` (that worker's), no callbacks (the driver keeps them)."""
        return cls(client=client)
