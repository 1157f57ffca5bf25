"""Where a store's rows live when no cache holds them: the whole table in the trainer, or the embedding shards.

:class:`ShardHome` is the one layer that counts embedding traffic: every fetch and write-back of a
trainer, its stores' and its prefetch worker's alike, goes through it. Reads outside the iterations
(evaluation, the final state, a checkpoint's view) are not counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrmflow.engine import row_files
from dlrmflow.engine.row_files import as_sharded, shard_file, write_rows_file
from dlrmflow.engine.serving.embedding_rows import INIT_CHUNK_ROWS, RowSpec, init_rows
from dlrmflow.engine.serving.shards import ShardGroup


def _host_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """A CPU tensor to receive fetched rows (pinned when the rows go on to a GPU)."""
    return torch.empty((rows, width), dtype=torch.float32, pin_memory=device.type == "cuda")


class ShardHome:
    """The embedding shards as a trainer's home, and the counters of what it moved to and from them.

    Owns ``bytes_fetched`` / ``bytes_written``; the store's compute thread and its prefetch worker both
    call it, never at once on one counter (the oracle's compute thread sends nothing while its worker runs)."""

    def __init__(self, spec: RowSpec, shards: ShardGroup | None) -> None:
        self.spec, self.shards = spec, shards
        self.bytes_fetched = 0
        self.bytes_written = 0

    def count_from(self, traffic: dict[str, int]) -> None:
        """Count on from a checkpoint's ``traffic``."""
        self.bytes_fetched, self.bytes_written = traffic["bytes_fetched"], traffic["bytes_written"]

    def exchange(self, write_ids: np.ndarray, write_rows: np.ndarray, fetch_ids: np.ndarray, out: np.ndarray) -> None:
        """Send ``write_rows`` of ``write_ids`` home and fetch ``fetch_ids`` into ``out``, in one round trip per
        shard (the shards apply the writes first); counted."""
        self.shards.exchange(write_ids, write_rows, fetch_ids, out=out)
        self.bytes_written += len(write_ids) * self.spec.row_bytes
        self.bytes_fetched += len(fetch_ids) * self.spec.row_bytes

    def exchange_to(self, write_ids: np.ndarray, write_rows: np.ndarray, fetch_ids: np.ndarray,
                    device: torch.device) -> torch.Tensor:
        """:meth:`exchange`, the fetched rows as a tensor on ``device``."""
        host = _host_buffer(len(fetch_ids), self.spec.width, device)
        self.exchange(write_ids, write_rows, fetch_ids, host.numpy())
        return host.to(device)

    def fetch(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        """The rows of ``ids`` on ``device``; counted."""
        host = _host_buffer(len(ids), self.spec.width, device)
        self.shards.fetch(ids, out=host.numpy())
        self.bytes_fetched += len(ids) * self.spec.row_bytes
        return host

    def write_back(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """``rows`` of ``ids`` home; counted."""
        self.shards.write_back(ids, rows)
        self.bytes_written += len(ids) * self.spec.row_bytes

    def held_by_trainer(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """A resumed cache holds ``rows`` (with parity: the old rows of their first write-backs)."""
        self.shards.held_by_trainer(ids, rows)

    def read(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        """The shards' rows of ``ids`` on ``device``, not counted (evaluation, a checkpoint's view): read, not
        fetched, so a coded group keeps no old rows of them (they are never written back)."""
        host = _host_buffer(len(ids), self.spec.width, device)
        self.shards.read(ids, out=host.numpy())
        return host.to(device)

    def all_rows(self) -> np.ndarray:
        return self.shards.all_rows()

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        return self.shards.row_chunks(chunk)

    def save_rows(self, directory: str | Path, *, chunk: int | None = None) -> list[dict[str, Any]]:
        return self.shards.save_rows(directory, chunk=chunk)

    def replace(self, shards: ShardGroup) -> ShardGroup:
        """Use ``shards`` from now on; returns the old group, for the caller to close. The counters go on."""
        old, self.shards = self.shards, shards
        return old

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()


class TableHome:
    """The whole table as one tensor on the training device (``local``): nothing moves, nothing is counted."""

    bytes_fetched = 0
    bytes_written = 0

    def __init__(self, spec: RowSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.table = torch.empty((spec.total_rows, spec.width), dtype=torch.float32, device=device)
        for lo in range(0, spec.total_rows, INIT_CHUNK_ROWS):
            hi = min(lo + INIT_CHUNK_ROWS, spec.total_rows)
            self.table[lo:hi] = torch.from_numpy(init_rows(spec, np.arange(lo, hi, dtype=np.int64)))

    def count_from(self, traffic: dict[str, int]) -> None:
        """Nothing moves: nothing to count."""

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    def gather(self, ids: np.ndarray) -> torch.Tensor:
        return self.table.index_select(0, self._index(ids))

    def scatter(self, ids: np.ndarray, block: torch.Tensor) -> None:
        self.table.index_copy_(0, self._index(ids), block)

    def read(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        return self.gather(ids).to(device)

    def all_rows(self) -> np.ndarray:
        return self.table.cpu().numpy()

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

    def load(self, rows) -> None:
        """Take ``rows`` (an array or a view of a checkpoint's shard files) as every row's value."""
        view = as_sharded(rows)
        if view.shape != tuple(self.table.shape):
            raise ValueError(f"the table holds rows of shape {tuple(self.table.shape)}, got {view.shape}")
        for start, chunk in view.chunks(row_files.ROW_CHUNK):
            self.table[start : start + len(chunk)] = torch.from_numpy(chunk)

    def close(self) -> None:
        """Nothing to release."""
