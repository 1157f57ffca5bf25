"""``local``: every embedding row in the trainer's memory, the one-trainer reference."""

from __future__ import annotations

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.row_updates import apply_update
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.stores.base import IterationRows, RowStore, rule_at
from dlrmflow.engine.training.stores.homes import TableHome


class LocalRows(RowStore):
    """The whole table as one tensor on the training device (:class:`~.homes.TableHome`)."""

    def __init__(self, spec: RowSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.home = TableHome(spec, device)

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        return IterationRows(t, split, next_union, self.home.gather(split.mine))

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        apply_update(rule_at(self.spec, lr), gathered.rows, grad)
        self.home.scatter(gathered.split.mine, gathered.rows)

    def current_rows(self, ids: np.ndarray) -> torch.Tensor:
        """The table is always current."""
        return self.read(ids)

    def logical_rows(self) -> np.ndarray:
        return self.home.all_rows().copy()

    def replace_shards(self, shards):
        raise TypeError("the local store has no shards")

    def restart_at(self, t: int, rows) -> None:
        """The table is the home: it takes ``rows`` (an array or a view of a checkpoint's shard files)."""
        self.home.load(rows)


def make_store(setup: RunSetup, device: torch.device, shards: None, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> LocalRows:
    return LocalRows(setup.spec, device)
