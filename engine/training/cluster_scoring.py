"""Scoring held-out rows on the Dask cluster: a part of the rows per task, the parts' summaries merged.

One process scoring Criteo Terabyte's held-out tenth (440M rows) at 32k rows/s takes hours; the cluster's
workers score parts of it side by side. The rows ``[start, stop)`` are cut into parts at multiples of the
batch size from ``start`` (:func:`split_rows`), so that every batch a part's task reads is a batch of the
one-process pass: each row is scored in a batch of the same rows and gets the same probability bits. A
task (:func:`score_part`) builds the model from its dense state (:class:`DenseModel`, scattered to the
workers once), reads the embedding rows it needs by id from the final state's shard files, memory-mapped
(:class:`StateFileRows`; :class:`InitRows` for ``dlrmflow evaluate``, whose rows start as a continued run
would), and returns its part's :class:`~.metrics.ScoreSummary`: its memory is its part, never the
trainer's. The driver merges the summaries as they come back (:class:`~.metrics.SummaryMerger`); the
merge is exact, so the metrics equal the one-process pass's bit for bit, whatever the order. Parts go
only to the workers with a thread free when the scoring starts (:func:`free_workers`): the other trainers
of a run of several hold theirs until trainer 0's evaluation ends.

A part that fails fails the whole scoring with one :class:`PartScoringError` naming the part (its rows)
and the error; the other parts are cancelled.

``dlrmflow predict`` scores the same way and keeps the scores: with :class:`PredictionParts` a part's task
also writes its rows' probabilities, one Parquet file per part (:func:`score_parts_in_process` runs the
same parts one after the other in this process, for the same files and bits).

The run directory and the dataset must be visible to every worker at the same path (as for the final
state itself: :mod:`dlrmflow.engine.row_files`).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import build_model
from dlrmflow.engine.phases import PhaseProgress
from dlrmflow.engine.row_files import ShardedRows
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.training.dense import deterministic_torch
from dlrmflow.engine.training.evaluation import evaluate, held_out_metrics, score_stream
from dlrmflow.engine.training.metrics import ScoreSummary, SummaryMerger
from dlrmflow.engine.training.stores.base import RowStore

if TYPE_CHECKING:
    from distributed import Client

# Below this many held-out rows the end-of-run evaluation stays in the trainer's process. On the cluster
# each worker's first part pays torch's deterministic-kernel import (torch.use_deterministic_algorithms
# loads its compiler settings: 2-7 s on 2 busy cores), besides sending the model and starting the tasks:
# 70k held-out rows of a small model took 10 s there against 1.2 s in the trainer. Half a million rows is
# about 15 s of the Criteo DLRM in one process.
CLUSTER_MIN_ROWS = 1 << 19
PARTS_PER_WORKER = 2  # more parts than workers: a slow worker holds up less of the end
MAX_PART_ROWS = 1 << 21  # a part's rows: its task's memory (the batch, the scores, their summary)


class PartScoringError(UserInputError):
    """A part of the rows scored on the cluster failed: names the part and its error."""


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count``: rows ``[start, stop)`` of the dataset."""

    index: int
    count: int
    start: int
    stop: int

    def __str__(self) -> str:
        return f"part {self.index + 1} of {self.count} (rows {self.start}..{self.stop - 1})"


def split_rows(start: int, stop: int, batch_size: int, workers: int, *, parts_per_worker: int = PARTS_PER_WORKER,
               max_part_rows: int = MAX_PART_ROWS) -> list[Part]:
    """Rows ``[start, stop)`` as parts of equal size, each a whole number of ``batch_size`` batches of the
    stream from ``start`` (the last part ends at ``stop``): ``parts_per_worker`` parts per worker, smaller
    when a part would exceed ``max_part_rows``."""
    rows = stop - start
    if rows <= 0:
        return []
    batches = -(-rows // batch_size)
    per_part = -(-batches // max(1, parts_per_worker * workers))
    per_part = max(1, min(per_part, max(1, max_part_rows // batch_size)))
    bounds = [(start + b * batch_size, min(stop, start + (b + per_part) * batch_size))
              for b in range(0, batches, per_part)]
    return [Part(i, len(bounds), lo, hi) for i, (lo, hi) in enumerate(bounds)]


@dataclass(frozen=True)
class DenseModel:
    """What a task builds the model from: its architecture (a config of :mod:`dlrmflow.engine.models`), its
    parameters (``state_dict``, on the CPU) and ``dim``, the values of an embedding row it reads
    (``RowSpec.dim``)."""

    config: Any
    state: dict[str, torch.Tensor]
    dim: int

    @classmethod
    def of(cls, config: Any, model: torch.nn.Module, dim: int) -> DenseModel:
        return cls(config, {k: v.detach().cpu() for k, v in model.state_dict().items()}, int(dim))

    def build(self, device: torch.device) -> torch.nn.Module:
        model = build_model(self.config).to(device)
        model.load_state_dict(self.state)
        return model.eval()


@dataclass(frozen=True)
class StateFileRows:
    """Embedding rows from a final state's shard files (a run's staged ``final_state``), memory-mapped by
    the task that reads them: ``shards``, the manifest's ``(file, sha256)`` entries in shard order."""

    directory: str
    shards: tuple[tuple[str, str | None], ...]
    total_rows: int
    width: int

    @classmethod
    def of(cls, directory: str | Path, entries: Sequence[dict[str, Any]], total_rows: int, width: int
           ) -> StateFileRows:
        return cls(str(Path(directory).resolve()), tuple((e["file"], e.get("sha256")) for e in entries),
                   int(total_rows), int(width))

    def reader(self, device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
        rows = ShardedRows.from_files(self.directory, [{"file": f, "sha256": s} for f, s in self.shards],
                                      self.total_rows, self.width)
        return lambda ids: torch.from_numpy(rows[ids]).to(device)


@dataclass(frozen=True)
class InitRows:
    """Embedding rows as ``spec`` starts them (:func:`~dlrmflow.engine.serving.embedding_rows.init_rows`):
    a finished run's final rows (``spec.start``, read from its files) and the hash of any id it never had."""

    spec: RowSpec

    def reader(self, device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
        return lambda ids: torch.from_numpy(init_rows(self.spec, ids)).to(device)


@dataclass(frozen=True)
class PredictionParts:
    """Where part tasks write their rows' predictions: ``directory/part-NNNNN.parquet`` per part (its
    index), columns ``row`` (int64, the row's number in the dataset), ``probability`` (float32, the bits the
    model computed) and, ``with_labels``, ``label`` (float32, as the model was scored against it)."""

    directory: str
    with_labels: bool = True

    def path(self, part: Part) -> Path:
        return Path(self.directory) / f"part-{part.index:05d}.parquet"

    def write(self, part: Part, labels: list[np.ndarray], probabilities: list[np.ndarray]) -> None:
        """Write ``part``'s scores (its batches', in row order) to :meth:`path`."""
        scores = np.concatenate(probabilities).reshape(-1) if probabilities else np.zeros(0, np.float32)
        if len(scores) != part.stop - part.start:
            raise RuntimeError(f"{part}: {len(scores)} scores for {part.stop - part.start} rows")
        columns = {"row": pa.array(np.arange(part.start, part.stop, dtype=np.int64)),
                   "probability": pa.array(scores.astype(np.float32, copy=False))}
        if self.with_labels:
            columns["label"] = pa.array(np.concatenate(labels).astype(np.float32, copy=False))
        pq.write_table(pa.table(columns), self.path(part), compression="snappy")


def score_part(part: Part, model: DenseModel, rows: StateFileRows | InitRows, dataset_dir: str, batch_size: int,
               device_type: str, known_rows: Sequence[int] | None = None,
               predictions: PredictionParts | None = None,
               progress: Callable[[int], None] | None = None) -> tuple[ScoreSummary, int]:
    """A Dask task: the summary of ``part``'s rows scored by ``model``, and its lookups of ids beyond
    ``known_rows`` (:func:`~.evaluation.score_stream`). On this worker's CUDA device for ``cuda``. With
    ``predictions``, also writes the part's probabilities there (its memory: the part's scores);
    ``progress(rows of the part done)`` after each batch (in this process: :func:`score_parts_in_process`)."""
    device = torch.device(device_type)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the run trains on CUDA and this worker sees no CUDA device")
    stream = BatchStream(dataset_dir, batch_size, start_row=part.start, stop_row=part.stop)
    labels: list[np.ndarray] = []
    probabilities: list[np.ndarray] = []

    def keep(batch_labels: np.ndarray, batch_probabilities: np.ndarray) -> None:
        labels.append(batch_labels)
        probabilities.append(batch_probabilities)

    with deterministic_torch(device), torch.no_grad():
        result = score_stream(stream, model.build(device), rows.reader(device), model.dim, device,
                              progress or (lambda done: None), known_rows=known_rows,
                              on_scores=None if predictions is None else keep)
    if predictions is not None:
        predictions.write(part, labels, probabilities)
    return result


def score_parts_in_process(dataset_dir: str | Path, start: int, stop: int, batch_size: int, model: DenseModel,
                           rows: StateFileRows | InitRows, *, device_type: str = "cpu",
                           progress: Callable[[int], None] | None = None, known_rows: Sequence[int] | None = None,
                           predictions: PredictionParts | None = None) -> tuple[ScoreSummary, int]:
    """:func:`score_on_cluster`'s parts scored one after the other in this process (as for one worker):
    the same batches, so the same bits, summaries and prediction files; ``progress(rows done)`` after each
    batch."""
    dataset_dir = str(Path(dataset_dir).resolve())
    merger, done, new_lookups = SummaryMerger(), 0, 0
    for part in split_rows(start, stop, batch_size, 1):
        summary, lookups = score_part(part, model, rows, dataset_dir, batch_size, device_type,
                                      None if known_rows is None else tuple(int(c) for c in known_rows),
                                      predictions,
                                      None if progress is None else lambda d, base=done: progress(base + d))
        merger.add(summary)
        new_lookups += lookups
        done += part.stop - part.start
    return merger.result(), new_lookups


def free_workers(client: Client) -> list[str]:
    """The workers with a thread free now. Not the others: with W > 1 trainers, each trainer's task holds its
    worker's thread until trainer 0's evaluation ends, so a part queued behind one would never start."""
    processing = client.processing()
    return sorted(address for address, info in cluster_workers(client).items()
                  if len(processing.get(address, ())) < int(info.get("nthreads", 1)))


def score_on_cluster(client: Client, dataset_dir: str | Path, start: int, stop: int, batch_size: int,
                     model: DenseModel, rows: StateFileRows | InitRows, *, device_type: str = "cpu",
                     progress: Callable[[int], None] | None = None, known_rows: Sequence[int] | None = None,
                     workers: Sequence[str] | None = None, predictions: PredictionParts | None = None
                     ) -> tuple[ScoreSummary, int]:
    """Rows ``[start, stop)`` of ``dataset_dir`` scored a part per task on ``client``'s workers (module
    docstring): the merged summary and the lookups of ids beyond ``known_rows``. ``progress(rows done)`` as
    parts finish; ``workers``: the worker addresses that run the parts (default: :func:`free_workers`);
    ``predictions``: where each part's task writes its rows' probabilities. PartScoringError when no worker
    is free."""
    from distributed import as_completed

    workers = list(free_workers(client) if workers is None else workers)
    if not workers:
        raise PartScoringError("no Dask worker has a thread free to score the rows on")
    parts = split_rows(start, stop, batch_size, len(workers))
    if not parts:
        return ScoreSummary.empty(), 0
    dataset_dir = str(Path(dataset_dir).resolve())
    [shared_model] = client.scatter([model], workers=workers, broadcast=True, hash=False)
    token = uuid.uuid4().hex[:12]
    futures = {client.submit(score_part, part, shared_model, rows, dataset_dir, batch_size, device_type,
                             None if known_rows is None else tuple(int(c) for c in known_rows), predictions,
                             key=f"score-part-{token}-{part.index}", workers=workers, allow_other_workers=False,
                             pure=False): part for part in parts}
    merger, done, new_lookups = SummaryMerger(), 0, 0
    try:
        for future in as_completed(futures):
            part = futures[future]
            try:
                summary, lookups = future.result()
            except Exception as exc:
                raise PartScoringError(f"scoring {part} of {dataset_dir} on the Dask cluster failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
            merger.add(summary)
            new_lookups += lookups
            done += part.stop - part.start
            if progress is not None:
                progress(done)
    finally:
        client.cancel([*futures, shared_model])
    return merger.result(), new_lookups


def _held_out_on_cluster(setup: Any, model: torch.nn.Module, device: torch.device, client: Client,
                         workers: list[str], directory: str | Path, files: Sequence[dict[str, Any]],
                         label: str) -> dict[str, Any]:
    """The run's held-out rows scored on ``workers`` by ``model`` from the shard ``files`` in ``directory``
    (a final state's, or a periodic evaluation's snapshot); the summary's evaluation fields."""
    config, meta, spec = setup.config, setup.meta, setup.spec
    summary, _ = score_on_cluster(client, config.dataset_dir, setup.eval_start, meta.rows, config.eval_batch_size,
                                  DenseModel.of(setup.model_config, model, spec.dim),
                                  StateFileRows.of(directory, files, spec.total_rows, spec.width),
                                  device_type=device.type, progress=PhaseProgress(label, meta.rows - setup.eval_start),
                                  workers=workers)
    return held_out_metrics(summary)


# The periodic evaluation's snapshot of the rows, in the run directory (every worker sees it), removed after.
EVALUATION_ROWS_DIR = "evaluation_rows"


def periodic_evaluation(setup: Any, model: torch.nn.Module, store: RowStore, device: torch.device,
                        client: Client | None) -> dict[str, Any]:
    """``--eval-every``'s evaluation between two iterations: the held-out rows scored as training has left
    them so far, on the cluster's free workers, or in this process as
    :func:`~.evaluation.evaluate` ``(during_training=True)`` does. Both give the same bits.

    On the cluster, the servers write their rows overlaid with the rows the store holds newer copies of
    (:meth:`~.stores.base.RowStore.held_rows`, sized by the cache), as a checkpoint writes them, into the run
    directory's :data:`EVALUATION_ROWS_DIR`; the tasks read them memory-mapped by id; the snapshot is removed
    after. The trainer waits, as it does for an evaluation in process: training cannot change a row while
    the tasks read. In this process instead: ``local`` (the trainer holds the table: no servers to write
    it), fewer than :data:`CLUSTER_MIN_ROWS` held-out rows, no free worker, or members of a coded group
    being rebuilt (their rows are not all home yet)."""
    config, meta = setup.config, setup.meta
    rows = meta.rows - setup.eval_start
    shards = getattr(store, "shards", None)
    rebuilding = bool(getattr(getattr(shards, "state", None), "lost", ()))
    workers = free_workers(client) if client is not None and shards is not None and not rebuilding and \
        rows >= CLUSTER_MIN_ROWS else []
    if not workers:
        return evaluate(setup, model, store, device, during_training=True)
    directory = Path(config.output_dir).resolve() / EVALUATION_ROWS_DIR
    shutil.rmtree(directory, ignore_errors=True)  # a snapshot left by a run that stopped while scoring
    directory.mkdir(parents=True)
    try:
        files = shards.save_rows(directory, store.held_rows())
        return _held_out_on_cluster(setup, model, device, client, workers, directory, files, "evaluation rows")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def final_evaluation(setup: Any, model: torch.nn.Module, store: RowStore, device: torch.device,
                     client: Client | None, state: dict[str, Any]) -> dict[str, Any]:
    """Trainer 0's evaluation at the end of the run, after the final state was written (``state``:
    :func:`~.final_state.write_final_state`'s result): on the cluster's free workers from the staged state's
    files when there is a client, a staged state, enough held-out rows (:data:`CLUSTER_MIN_ROWS`) and a free
    worker, else in this process from the store (:func:`~.evaluation.evaluate`). Both give the same bits."""
    rows = setup.meta.rows - setup.eval_start
    workers = free_workers(client) if client is not None and state.get("staged") is not None and \
        rows >= CLUSTER_MIN_ROWS else []
    if not workers:
        return evaluate(setup, model, store, device)
    return _held_out_on_cluster(setup, model, device, client, workers, state["staged"], state["manifest"]["shards"],
                                "final evaluation rows")
