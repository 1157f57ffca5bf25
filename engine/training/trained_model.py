"""A finished run's trained model as a ``torch.nn.Module``: ``dlrmflow.load_model(RUN_DIR)``.

The model is the run's dense part (:mod:`dlrmflow.engine.models`, from ``final_state/dense.pt``) and its
embedding rows, read by id from the final state's shard files memory-mapped (:class:`~dlrmflow.engine.
row_files.ShardedRows`): loading reads the dense part only, and a batch reads the rows it looks up, so a
model whose tables exceed the memory still loads.

:meth:`TrainedModel.predict` scores a batch exactly as ``dlrmflow evaluate`` scores a batch of the same rows
(:func:`~.evaluation.score_stream`: the batch's unique ids' rows, their first ``dim`` values, gathered by
``index_select``, deterministic kernels): the click probabilities are the same bits. Rows are batch-shaped
computations, so a row's bits are those of evaluate's when the batch holds the same rows (evaluate cuts the
dataset into batches of ``--batch-size`` from its first row).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.row_files import ROW_CHUNK, ShardedRows
from dlrmflow.engine.run_state import StateDigest, StateFormatError, load_dense, read_manifest
from dlrmflow.engine.training.continuation import FinishedRun, read_finished_run
from dlrmflow.engine.training.dense import deterministic_torch


class ModelInputError(UserInputError):
    """A batch given to a trained model does not fit it (its shapes, its ids)."""


@dataclass(frozen=True)
class Features:
    """The dataset columns a model reads, in its order: dense features, then one table per sparse feature, and
    the dataset directory (None: the run's dataset is gone or was rewritten, so its column names are unknown)."""

    dense: tuple[str, ...] | None
    sparse: tuple[str, ...] | None
    dataset: str | None


def run_features(run: FinishedRun) -> Features:
    """The column names of the dataset ``run`` trained on, when that dataset is still the one it trained on."""
    from dlrmflow.datasets.meta import DatasetError, read_meta

    try:
        meta = read_meta(run.summary["dataset"])
    except DatasetError:
        return Features(None, None, None)
    if meta.fingerprint != run.summary["dataset_fingerprint"]:
        return Features(None, None, None)
    return Features(tuple(meta.dense_columns), tuple(meta.sparse_columns), str(run.summary["dataset"]))


def open_state_rows(run: FinishedRun) -> ShardedRows:
    """The run's final rows, memory-mapped; StateFormatError when a shard file is missing or of another shape."""
    manifest = read_manifest(run.run_dir)
    try:
        return ShardedRows.from_files(manifest["dir"], manifest["shards"], manifest["total_rows"], manifest["width"])
    except (OSError, ValueError, KeyError) as exc:
        raise StateFormatError(f"RUN_DIR {run.run_dir}: its {Path(manifest['dir']).name}/ is damaged: "
                               f"{type(exc).__name__}: {exc}") from None


def read_dense_state(run: FinishedRun) -> dict[str, Any]:
    """``final_state/dense.pt``; StateFormatError when it is missing or unreadable."""
    try:
        return load_dense(run.run_dir)
    except StateFormatError:
        raise
    except Exception as exc:  # a truncated or overwritten pickle raises whatever torch.load meets
        first_line = (str(exc).strip().splitlines() or [""])[0]  # torch.load's messages run to paragraphs
        raise StateFormatError(f"RUN_DIR {run.run_dir}: final_state/dense.pt cannot be read: "
                               f"{type(exc).__name__}: {first_line}") from None


class TrainedModel(nn.Module):
    """A finished run's model (module docstring). ``forward(dense, sparse)``: click logits ``[n]`` from dense
    features ``[n, num_dense]`` (float32) and table-local ids ``[n, num_tables]``, the columns of the
    preprocessed dataset; :meth:`predict` takes a batch of those columns and returns probabilities."""

    def __init__(self, run_dir: str, model_name: str, dense_model: nn.Module, rows: ShardedRows, dim: int,
                 table_offsets: tuple[int, ...], cardinalities: tuple[int, ...], features: Features,
                 state_sha256: str) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.model_name = model_name
        self.model = dense_model
        self.rows = rows  # memory-mapped, not parameters: the tables never enter a state_dict
        self.dim = int(dim)
        self.table_offsets = tuple(int(o) for o in table_offsets)
        self.cardinalities = tuple(int(c) for c in cardinalities)
        self.features = features
        self.state_sha256 = state_sha256
        self.eval()

    @property
    def config(self) -> Any:
        """The architecture (a config dataclass of :mod:`dlrmflow.engine.models`)."""
        return self.model.config

    @property
    def num_dense(self) -> int:
        return int(self.model.config.num_dense)

    @property
    def num_tables(self) -> int:
        return len(self.cardinalities)

    def table_rows(self, table: int) -> np.ndarray:
        """Table ``table``'s weights ``[cardinality, dim]`` (float32, read from the shard files into memory)."""
        start = self.table_offsets[table]
        ids = np.arange(start, start + self.cardinalities[table], dtype=np.int64)
        # A copy of the weights alone: a view would keep (and torch.save would write) the optimizer state too.
        return np.ascontiguousarray(self.rows[ids][:, : self.dim])

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        sparse_ids = self._checked_ids(np.asarray(sparse.detach().cpu() if isinstance(sparse, torch.Tensor)
                                                  else sparse))
        device = dense.device
        ids = sparse_ids + np.asarray(self.table_offsets, np.int64)[None, :]
        # As evaluation.score_stream: each unique id's row once, then gathered.
        unique, inverse = np.unique(ids, return_inverse=True)
        weights = torch.from_numpy(self.rows[unique]).to(device)[:, : self.dim]
        embeddings = weights.index_select(0, torch.from_numpy(inverse.reshape(-1)).to(device))
        return self.model(dense, embeddings.view(ids.shape[0], ids.shape[1], self.dim))

    @torch.no_grad()
    def predict(self, batch: Any) -> np.ndarray:
        """Click probabilities (float32 ``[n]``) of a batch of the dataset's columns: an object with ``dense``
        ``[n, num_dense]`` and ``sparse`` ``[n, num_tables]`` (a :class:`~dlrmflow.engine.batch_stream.Batch`),
        a mapping with those keys, or a table (pandas DataFrame, pyarrow Table) with the dataset's column names."""
        dense, sparse = self._columns(batch)
        device = next(self.model.parameters()).device
        with deterministic_torch(device):
            # torch.tensor copies into torch-allocated memory, as evaluation.batch_tensors does: the kernels
            # take the same path whatever NumPy's buffer alignment was.
            logits = self(torch.tensor(dense, device=device), sparse)
            return torch.sigmoid(logits).cpu().numpy()

    def _columns(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(batch, Mapping):
            dense, sparse = batch["dense"], batch["sparse"]
        elif hasattr(batch, "dense") and hasattr(batch, "sparse"):
            dense, sparse = batch.dense, batch.sparse
        elif hasattr(batch, "column_names") or hasattr(batch, "columns"):
            dense, sparse = self._table_columns(batch)
        else:
            raise ModelInputError(f"predict takes a batch with dense and sparse columns (a Batch, a mapping or "
                                  f"a table with the dataset's column names), got {type(batch).__name__}")
        dense = np.asarray(dense, dtype=np.float32)
        if dense.ndim != 2 or dense.shape[1] != self.num_dense:
            raise ModelInputError(f"dense features: expected [n, {self.num_dense}], got {list(dense.shape)}")
        sparse = self._checked_ids(np.asarray(sparse))
        if len(sparse) != len(dense):
            raise ModelInputError(f"{len(dense)} rows of dense features, {len(sparse)} of sparse ids")
        return dense, sparse

    def _table_columns(self, table: Any) -> tuple[np.ndarray, np.ndarray]:
        if self.features.sparse is None:
            raise ModelInputError(f"the dataset {self.run_dir} trained on is gone or was rewritten: its column "
                                  "names are unknown; give predict a mapping with dense and sparse arrays")
        names = table.column_names if hasattr(table, "column_names") else list(table.columns)
        missing = [c for c in (*self.features.dense, *self.features.sparse) if c not in names]
        if missing:
            raise ModelInputError(f"the batch lacks the dataset's columns {', '.join(missing[:5])}")

        def column(name: str) -> np.ndarray:
            values = table[name]
            return values.to_numpy() if hasattr(values, "to_numpy") else np.asarray(values)

        n = table.num_rows if hasattr(table, "num_rows") else len(table)
        dense = np.stack([column(c) for c in self.features.dense], axis=1) if self.features.dense else \
            np.zeros((n, 0), np.float32)
        return dense, np.stack([column(c) for c in self.features.sparse], axis=1)

    def _checked_ids(self, sparse: np.ndarray) -> np.ndarray:
        if sparse.ndim != 2 or sparse.shape[1] != self.num_tables:
            raise ModelInputError(f"sparse ids: expected [n, {self.num_tables}], got {list(sparse.shape)}")
        if not np.issubdtype(sparse.dtype, np.integer):
            raise ModelInputError(f"sparse ids must be integers, got {sparse.dtype}")
        sparse = sparse.astype(np.int64, copy=False)
        if sparse.size:
            beyond = (sparse < 0) | (sparse >= np.asarray(self.cardinalities, np.int64)[None, :])
            if beyond.any():
                row, table = (int(x[0]) for x in np.nonzero(beyond))
                name = self.features.sparse[table] if self.features.sparse else f"table {table}"
                raise ModelInputError(f"row {row}: id {int(sparse[row, table])} of {name} lies outside the "
                                      f"model's {self.cardinalities[table]} rows of that table (ids are "
                                      "0 .. cardinality - 1, as the run's dataset numbers them)")
        return sparse


def verify_state(run: FinishedRun, dense: dict[str, Any], rows: ShardedRows, chunk: int = ROW_CHUNK) -> None:
    """Recompute the state SHA-256 from dense.pt and the rows (every row read once, a chunk at a time) and
    compare it with the manifest's: StateFormatError when a file was changed or damaged."""
    digest = StateDigest(dense).rows(rows.total_rows, rows.width)
    for _, block in rows.chunks(chunk):
        digest.update(block)
    if digest.hexdigest() != run.manifest["state_sha256"]:
        raise StateFormatError(f"RUN_DIR {run.run_dir}: its final_state/ files do not hash to the manifest's state "
                               "SHA-256: they were changed or damaged")


def load_model(run_dir: str | os.PathLike, *, device: str = "cpu", verify: bool = False) -> TrainedModel:
    """The trained model of the finished run ``run_dir`` in eval mode (module docstring). ``verify``: read every
    row once to check the final state against its manifest's SHA-256 (else only the files' shapes are checked).
    UserInputError (one line) for a directory without a finished run or with a damaged final state."""
    from dlrmflow.engine.models.registry import build_model, config_of

    run = read_finished_run(run_dir, option="RUN_DIR")
    dense = read_dense_state(run)
    rows = open_state_rows(run)
    embedding = dense["embedding"]
    dim = int(embedding["dim"])
    if rows.width != dim + int(embedding["state_width"]) or rows.total_rows != sum(embedding["cardinalities"]):
        raise StateFormatError(f"RUN_DIR {run_dir}: its rows are [{rows.total_rows}, {rows.width}], its dense.pt "
                               f"says {sum(embedding['cardinalities'])} rows of {dim} weights and "
                               f"{embedding['state_width']} optimizer values")
    if verify:
        verify_state(run, dense, rows)
    model = build_model(config_of(dense["model"], dense["model_config"]))
    model.load_state_dict(dense["dense"])
    return TrainedModel(run.run_dir, dense["model"], model, rows, dim, tuple(embedding["table_offsets"]),
                        tuple(embedding["cardinalities"]), run_features(run),
                        str(run.manifest["state_sha256"])).to(torch.device(device))
