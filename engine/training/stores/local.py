"""``local``: every embedding row in the trainer's memory, the one-trainer reference."""

from __future__ import annotations

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import INIT_CHUNK_ROWS, RowSpec, init_rows
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.setup import RunSetup
from dlrmflow.engine.training.stores.base import OneTrainerRows


class LocalRows(OneTrainerRows):
    """The whole table as one tensor on the training device."""

    def __init__(self, spec: RowSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.table = torch.empty((spec.total_rows, spec.width), dtype=torch.float32, device=device)
        for lo in range(0, spec.total_rows, INIT_CHUNK_ROWS):
            hi = min(lo + INIT_CHUNK_ROWS, spec.total_rows)
            self.table[lo:hi] = torch.from_numpy(init_rows(spec, np.arange(lo, hi, dtype=np.int64)))

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    def gather_ids(self, t: int, ids: np.ndarray) -> torch.Tensor:
        return self.table.index_select(0, self._index(ids))

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        self.table.index_copy_(0, self._index(ids), block)

    def read(self, ids: np.ndarray) -> torch.Tensor:
        return self.gather_ids(-1, ids)

    def all_rows(self) -> np.ndarray:
        return self.table.cpu().numpy()

    def logical_rows(self) -> np.ndarray:
        return self.table.cpu().numpy().copy()

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """The table is the home: it takes ``rows``."""
        if rows.shape != tuple(self.table.shape):
            raise ValueError(f"the table holds rows of shape {tuple(self.table.shape)}, got {rows.shape}")
        self.table.copy_(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)))


def make_store(setup: RunSetup, device: torch.device, shards: None, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> LocalRows:
    return LocalRows(setup.spec, device)
