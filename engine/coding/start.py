"""Starting a coded shard group: members placed on the cluster, standby replacements on a spare worker."""

from __future__ import annotations

from typing import Any

import numpy as np
from distributed import Client

from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.group import PARITY_BATCHES, REBUILD_CHUNK, CodedShardGroup, RecoveryRunner
from dlrmflow.engine.coding.members import start_member
from dlrmflow.engine.coding.rebuild import start_rebuild_thread
from dlrmflow.engine.coding.rebuild_state import Standby
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.placement import choose_rebuild_worker, place
from dlrmflow.engine.serving.shards import remote, wait_all, warm_up_workers


def place_members(client: Client, n: int) -> tuple[list[str], bool]:
    """Workers for the ``n`` members by :func:`~dlrmflow.engine.serving.placement.place`: those with the
    ``embedding_server`` resource when any has it; distinct hosts, then distinct workers, then round robin.

    Returns the addresses and whether some members share a worker."""
    placement = place(cluster_workers(client), n)
    return placement.workers, placement.shares_worker


def start_coded_shards(client: Client, spec: RowSpec, num_shards: int, parity: int, *,
                       rebuild_chunk: int = REBUILD_CHUNK, parity_batches: int = PARITY_BATCHES,
                       rebuild_rate: float = 0.0, recovery_runner: RecoveryRunner | None = None,
                       rows: np.ndarray | None = None) -> CodedShardGroup:
    """K coded data shards and R parity shards: parity = the encoding of the initial rows, or of
    ``rows`` ``[total_rows, width]`` when given (a resumed run's checkpoint)."""
    code = ErasureCode(num_shards, parity)
    workers, shared = place_members(client, code.n_shards)
    # Every worker, spares included, imports the copy tasks' code now: a rebuild starts at once.
    warm_up_workers(client, "dlrmflow.engine.coding.rebuild")
    futures = [start_member(client, spec, code, s, w, initialise=rows is None) for s, w in enumerate(workers)]
    actors = [f.result() for f in futures]
    if rows is not None:
        data = [np.ascontiguousarray(rows[i :: code.k]) for i in range(code.k)]
        pieces = [*data, *code.encode(data)]  # shorter data shards count as zero-padded, as in the group
        for call in [actors[s].install(0, piece) for s, piece in enumerate(pieces)]:
            call.result()
    group = CodedShardGroup(spec, client, code, actors, futures, workers, rebuild_chunk=rebuild_chunk,
                            parity_batches=parity_batches, rebuild_rate=rebuild_rate, recovery_runner=recovery_runner,
                            start_rebuild=start_rebuild_thread)
    if rows is not None:
        group.written[:] = True  # rows from a checkpoint: any of them may differ from its initial value
    group.shared_workers = shared
    group.state.standbys_set(start_standbys(client, spec, code, actors, workers))
    return group


def start_standbys(client: Client, spec: RowSpec, code: ErasureCode, members: list,
                   busy: list[str]) -> dict[int, Standby]:
    """A fresh replacement for every member (``members``, on workers ``busy``) on a worker that hosts
    none, if there is one (else none: a rebuild then starts its replacement when it needs it)."""
    spare = choose_rebuild_worker(cluster_workers(client), busy)
    if spare is None:
        return {}
    futures = [start_member(client, spec, code, s, spare, initialise=False) for s in range(code.n_shards)]
    standby = {s: (spare, future, future.result()) for s, future in enumerate(futures)}
    client.submit(open_links, members, workers=[spare], allow_other_workers=False, pure=False).result()
    return standby


def open_links(members: list[Any]) -> int:
    """Runs as a Dask task on the standbys' worker: one call to every member, so that the worker's
    client and its connections to the members' workers exist before a rebuild's first reads need them."""
    opened, _ = wait_all([(s, remote(member, "pid")) for s, member in enumerate(members)])
    return len(opened)  # a member already lost is left out: its rebuild does without this
