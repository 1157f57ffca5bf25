"""Embedding shards started from a checkpoint's rows, and the reload after a lost shard.

Restoring starts every shard from its own rows file (it reads it on its worker); the store reads the few
rows it caches from the files too (:class:`~dlrmflow.engine.row_files.ShardedRows`). After a lost shard
(without parity) :func:`restore_checkpoint` starts K fresh shards away from the workers that stopped
answering, drops what the store held and restarts it at the checkpoint's iteration.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch
from distributed import Client

from dlrmflow.engine.row_files import ShardedRows, as_sharded
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import (
    EmbeddingShard,
    ShardGroup,
    answer,
    is_lost_actor_error,
    remote,
    start_placed_actors,
    wait_all,
)
from dlrmflow.engine.training.checkpoint_format import (
    CheckpointedStore,
    cache_of,
    checkpoint_rows,
    load_checkpoint,
    restore_dense,
)
from dlrmflow.engine.training.prefetch import PrefetchError


class RestoredShard(EmbeddingShard):
    """An embedding shard that starts from given rows instead of the initial ones: created empty, then it
    reads its own rows file (:meth:`~dlrmflow.engine.serving.shards.EmbeddingShard.load_rows`) or, for rows
    held in the caller's process (an array, or files of another number of shards), :meth:`restore`
    receives its rows in an actor call, straight from the caller to the worker (as task arguments they
    would travel inside the graph, via the scheduler)."""

    def __init__(self, spec: RowSpec, shard: int, num_shards: int) -> None:
        super().__init__(spec, shard, num_shards, initialise=False)

    def restore(self, rows: np.ndarray) -> int:
        """All of this shard's rows, copied as bytes."""
        if rows.shape != self.rows.shape or rows.dtype != np.float32:
            raise ValueError(f"shard {self.shard} holds float32 rows of shape {self.rows.shape}, "
                             f"got {rows.dtype} {rows.shape}")
        self.rows.view(np.uint8)[:] = np.ascontiguousarray(rows).view(np.uint8)
        return len(rows)


def start_placed_shards(client: Client, spec: RowSpec, k: int, rows: np.ndarray | ShardedRows | None = None, *,
                        avoid: Collection[str] | None = None) -> ShardGroup:
    """K shards placed like every group's (:func:`~dlrmflow.engine.serving.placement.place`), remembering where
    each is (``worker_of``). At a run's start every worker is warmed up (spares included: a restore
    may use them); a restore passes ``avoid``.

    After a loss the scheduler may list the dead worker for a while: a shard placed there would
    wait for it forever, and a broadcast to it fails or waits out Dask's connect timeout. So a
    restore places away from ``avoid`` (the workers of the shards that stopped answering) and warms
    up only the workers it chose (:func:`~dlrmflow.engine.serving.shards.start_placed_actors`, which also
    places again without a chosen worker that leaves before its shard started)."""
    shard_class = EmbeddingShard if rows is None else RestoredShard
    placement, futures, actors = start_placed_actors(
        client, k, lambda i, w: client.submit(shard_class, spec, i, k, actor=True, workers=[w], pure=False),
        "an embedding server", avoid=avoid)
    group = ShardGroup(spec, actors, futures, worker_of=list(placement.workers))
    rows = as_sharded(rows)
    if rows is not None and rows.files is not None and rows.num_shards == k:
        group.load_rows(rows.files)  # each shard reads its own file
    elif rows is not None:
        for call in [actor.restore(rows.local_rows(i, k)) for i, actor in enumerate(group.actors)]:
            answer(call)
    return group


def workers_not_answering(group: ShardGroup) -> set[str]:
    """The workers of ``group``'s shards whose actors are lost (a call fails as a lost worker's does)."""
    _, error = wait_all([(i, remote(actor, "stats")) for i, actor in enumerate(group.actors)])
    return set() if error is None else {group.worker_of[i] for i in error.members}


def is_lost_shard(exc: BaseException) -> bool:
    """A failed call to an actor whose worker died (also when the oracle's prefetch worker made it)."""
    if isinstance(exc, PrefetchError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return is_lost_actor_error(exc)


def restore_checkpoint(path: Path, client: Client, store: CheckpointedStore, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> int:
    """Reload ``path`` into fresh shards, the store (restarted at the checkpoint's iteration, what it
    held dropped) and the dense model; the iteration to replay from."""
    state = load_checkpoint(path)
    t, rows = int(state["iteration"]), checkpoint_rows(path, state)
    store.drop_pending()  # also stops background traffic (the oracle's worker) before the old shards go away
    restored = start_placed_shards(client, store.spec, store.shards.num_shards, rows,
                                   avoid=workers_not_answering(store.shards))
    store.replace_shards(restored).close()  # the survivors hold newer rows than the checkpoint: drop them
    store.restart_at(t, rows)
    store.restore_cache(cache_of(state), rows)
    restore_dense(state, model, optimizer)
    return t
