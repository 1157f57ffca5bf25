"""Starting a coded shard group: members placed on the cluster, standby replacements on a spare worker.

The data shards start from their initial rows or, on a resume, each from its own checkpoint file; the
parity shards then encode themselves from the data shards' rows streamed to their workers a chunk of
stripes at a time (:func:`~dlrmflow.engine.coding.members.encode_parity_from_members`): the rows of the
data shards never meet in one process."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
from distributed import Client

from dlrmflow.engine import row_files
from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.group import PARITY_BATCHES, REBUILD_CHUNK, CodedShardGroup, RecoveryRunner
from dlrmflow.engine.coding.members import encode_parity_from_members, num_stripes, start_member
from dlrmflow.engine.coding.rebuild import start_rebuild_thread
from dlrmflow.engine.coding.rebuild_state import Standby
from dlrmflow.engine.row_files import ShardedRows, as_sharded, chunk_stripes
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.dask_internals import local_actor
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.placement import choose_rebuild_worker
from dlrmflow.engine.serving.shards import answer, place_avoiding, remote, start_placed_actors, wait_all


def place_members(client: Client, n: int, avoid: Collection[str] = ()) -> tuple[list[str], bool]:
    """Workers for the ``n`` members, none of ``avoid`` (:func:`~dlrmflow.engine.serving.shards.place_avoiding`).

    Returns the addresses and whether some members share a worker."""
    placement = place_avoiding(client, n, avoid)
    return placement.workers, placement.shares_worker


def start_coded_shards(client: Client, spec: RowSpec, num_shards: int, parity: int, *,
                       rebuild_chunk: int = REBUILD_CHUNK, parity_batches: int = PARITY_BATCHES,
                       rebuild_rate: float = 0.0, recovery_runner: RecoveryRunner | None = None,
                       rows: np.ndarray | ShardedRows | None = None) -> CodedShardGroup:
    """K coded data shards and R parity shards: parity = the encoding of the initial rows, or of
    ``rows`` when given (a resumed run's checkpoint: its shard files, each data shard reading its own; or
    rows ``[total_rows, width]`` held in this process: tests), streamed from the data shards."""
    code = ErasureCode(num_shards, parity)
    # Every worker, spares included, imports the copy tasks' code first: a rebuild starts at once.
    placement, futures, actors = start_placed_actors(
        client, code.n_shards,
        lambda s, worker: start_member(client, spec, code, s, worker, initialise=rows is None and s < code.k),
        "a coded shard", warm_up="dlrmflow.engine.coding.rebuild")
    workers, shared = placement.workers, placement.shares_worker
    if rows is not None:
        restore_data_shards(code, as_sharded(rows), actors[: code.k])
    encode_parity(client, spec, code, actors, workers)
    group = CodedShardGroup(spec, client, code, actors, futures, workers, rebuild_chunk=rebuild_chunk,
                            parity_batches=parity_batches, rebuild_rate=rebuild_rate, recovery_runner=recovery_runner,
                            start_rebuild=start_rebuild_thread)
    if rows is not None:
        group.mark_all_written()  # rows from a checkpoint: any of them may differ from its initial value
    group.shared_workers = shared
    group.state.standbys_set(start_standbys(client, spec, code, actors, workers))
    return group


def restore_data_shards(code: ErasureCode, rows: ShardedRows, data: list) -> None:
    """Each data shard's rows from a checkpoint: read by the shard from its own file, or (rows held in
    this process: tests) installed from here."""
    if rows.files is not None and rows.num_shards == code.k:
        calls = [data[i].load_rows(path, sha, row_files.ROW_CHUNK) for i, (path, sha) in enumerate(rows.files)]
    else:
        calls = [data[i].install(0, rows.local_rows(i, code.k)) for i in range(code.k)]
    for call in calls:
        answer(call)


def encode_parity(client: Client, spec: RowSpec, code: ErasureCode, members: list, workers: list[str]) -> None:
    """Every parity shard encodes its rows from the data shards' current rows, on its own worker
    (:func:`encode_parity_task`), all at once."""
    n_stripes, chunk = num_stripes(spec, code.k), chunk_stripes(code.k, row_files.ROW_CHUNK)
    futures = [client.submit(encode_parity_task, code.k, code.r, s - code.k, members[: code.k], members[s],
                             spec.width, n_stripes, chunk, workers=[workers[s]], allow_other_workers=False,
                             pure=False)
               for s in range(code.k, code.n_shards)]
    client.gather(futures)


def encode_parity_task(k: int, r: int, p: int, data: list[Any], parity: Any, width: int, n_stripes: int,
                       chunk: int) -> int:
    """Runs as a Dask task on parity shard ``p``'s worker: its rows encoded from the data shards' rows,
    streamed worker to worker (:func:`~dlrmflow.engine.coding.members.encode_parity_from_members`), and
    installed in memory on the parity shard this worker hosts."""
    return encode_parity_from_members(ErasureCode(k, r), width, data, local_actor(parity) or parity, p, n_stripes,
                                      chunk)


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
