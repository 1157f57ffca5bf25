"""``local``: every embedding row in the trainer's memory, the one-trainer reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrmflow.engine import row_files
from dlrmflow.engine.row_files import as_sharded, shard_file, write_rows_file
from dlrmflow.engine.serving.embedding_rows import INIT_CHUNK_ROWS, RowSpec, init_rows
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.run_setup import RunSetup
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

    current_rows = read  # the table is always current

    def all_rows(self) -> np.ndarray:
        return self.table.cpu().numpy()

    def logical_rows(self) -> np.ndarray:
        return self.table.cpu().numpy().copy()

    def _rows(self, start: int, stop: int) -> np.ndarray:
        return self.table[start:stop].cpu().numpy()

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        chunk = chunk or row_files.ROW_CHUNK
        for start in range(0, self.spec.total_rows, chunk):
            yield self._rows(start, min(start + chunk, self.spec.total_rows))

    def save_rows(self, directory: str | Path, *, chunk: int | None = None) -> list[dict[str, Any]]:
        """The table is the home, in this process: one file, as one shard holding every row."""
        return [write_rows_file(Path(directory) / shard_file(0), self.spec.total_rows, self.spec.width, self._rows,
                                chunk=chunk or row_files.ROW_CHUNK)]

    def restart_at(self, t: int, rows) -> None:
        """The table is the home: it takes ``rows`` (an array or a view of a checkpoint's shard files)."""
        view = as_sharded(rows)
        if view.shape != tuple(self.table.shape):
            raise ValueError(f"the table holds rows of shape {tuple(self.table.shape)}, got {view.shape}")
        for start, chunk in view.chunks(row_files.ROW_CHUNK):
            self.table[start : start + len(chunk)] = torch.from_numpy(chunk)


def make_store(setup: RunSetup, device: torch.device, shards: None, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> LocalRows:
    return LocalRows(setup.spec, device)
