"""How W trainers' row gradients reach the rows: the parts the W-trainer stores share.

A row used by several trainers at ``t`` gets the rank-order sum of their gradients
(:func:`~dlrmflow.engine.training.collectives.sum_over_users`), applied once per copy of the row. The remote
and LRU stores gather every gradient on every trainer (:func:`gather_gradients`) and write each updated row
home through its lowest user, then wait for every trainer's writes (:class:`WriteThrough`); the oracle's
LRPP cache sends each gradient only to the row's holders (:mod:`.oracle`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import PendingGather, TrainerGroup
from dlrmflow.engine.training.stores.homes import ShardHome


def gather_gradients(group: TrainerGroup, split: BatchSplit, mask: np.ndarray, grad: torch.Tensor, kind: str, *,
                     async_op: bool = False) -> tuple[list[np.ndarray], list | PendingGather]:
    """Every trainer's gradients of its rows that ``mask`` (over the union) selects: (ids per trainer, rows per
    trainer)."""
    ids = split.held(mask)
    mine = mask[split.where[split.rank]]
    rows = grad[torch.from_numpy(np.flatnonzero(mine))]
    gathered = group.all_gather_rows(rows, [len(i) for i in ids], kind, async_op=async_op)
    return ids, gathered


class WriteThrough:
    """Each updated row home in its iteration, then a barrier: no trainer reads a server before every
    trainer's writes of the iteration are there. ``sync_seconds``: time in the barrier."""

    def __init__(self, group: TrainerGroup, home: ShardHome) -> None:
        self.group, self.home = group, home
        self.sync_seconds = 0.0

    def write(self, ids: np.ndarray, rows: torch.Tensor) -> float:
        """Write ``rows`` of ``ids`` home, then wait for the other trainers' writes; returns the seconds spent
        writing (the barrier counts as sync)."""
        start = time.perf_counter()
        self.home.write_back(ids, rows.cpu().numpy())
        written = time.perf_counter()
        self.group.barrier()
        self.sync_seconds += time.perf_counter() - written
        return written - start
