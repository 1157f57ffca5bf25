"""A finished run's model scored on a dataset, without training: ``dlrmflow evaluate RUN_DIR DATASET``.

Progressive validation, as CTR teams report it: yesterday's model on today's data before it trains on
it. The dataset's vocabulary must keep the run's ids (the same dataset, or one grown from it:
:mod:`.continuation`); a row the run never had (a value new today) reads as a continued run would start
it (:func:`~dlrmflow.engine.serving.embedding_rows.init_rows`), and the result says how many lookups
met such a row.

Reported: AUC, log loss, and the constant-prediction log loss (every row predicted at the data's click
rate: the entropy of the labels, the baseline a model must beat; log loss / that = normalised entropy).
The rows come from the run's shard files, memory-mapped, by id: no process holds the tables. With a
Dask client the rows are scored a part per task on its workers and the parts' summaries merged exactly
(:mod:`.cluster_scoring`); without, in this process, a chunk at a time: the same numbers either way.
:func:`scores_on_cluster` is the rule the command and the daily loop follow.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from dlrmflow.datasets.meta import DatasetMeta, read_meta
from dlrmflow.engine.models import row_init_std
from dlrmflow.engine.models.registry import config_of
from dlrmflow.engine.phases import PhaseProgress
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.training import cluster_scoring
from dlrmflow.engine.training.cluster_scoring import DenseModel, InitRows
from dlrmflow.engine.training.continuation import (
    FinishedRun,
    InitFromError,
    parent_cardinalities,
    read_finished_run,
)
from dlrmflow.engine.training.metrics import LogLossSum

if TYPE_CHECKING:
    from distributed import Client


def constant_log_loss(positives: int, rows: int) -> float | None:
    """Log loss of predicting every one of ``rows`` rows at their own positive rate (None without rows)."""
    return LogLossSum.constant(positives, rows).value() if rows else None


SCORE_ON = ("auto", "cluster", "process")  # where `dlrmflow evaluate --score-on` scores the rows


def scores_on_cluster(score_on: str, rows: int, address: str | None) -> bool:
    """Whether a scoring of ``rows`` rows runs on a Dask cluster: ``cluster`` always, ``process`` never,
    ``auto`` when a scheduler's address is given (the option or $DLRMFLOW_DASK_ADDRESS: the user has a
    cluster) or there are at least :data:`~.cluster_scoring.CLUSTER_MIN_ROWS` rows (below that, starting a
    LocalCluster and each worker's first part cost more than they save)."""
    from dlrmflow.engine.serving.cluster import resolve_address
    from dlrmflow.engine.training.cluster_scoring import CLUSTER_MIN_ROWS

    if score_on not in SCORE_ON:
        raise ValueError(f"score_on: expected one of {', '.join(SCORE_ON)}, got {score_on!r}")
    if score_on != "auto":
        return score_on == "cluster"
    return resolve_address(address) is not None or rows >= CLUSTER_MIN_ROWS


def scoring_setup(run: FinishedRun, meta: DatasetMeta, dataset_dir: str | os.PathLike, where: str
                  ) -> tuple[dict[str, Any], Any, list[int], RowSpec]:
    """What scoring ``run``'s final model on a dataset (``meta``) needs: its dense state (``dense.pt``), its
    model's config, the run's table sizes (InitFromError when the dataset's ids do not keep its dataset's),
    and the rows' :class:`RowSpec`: the run's final rows, a row it never had as a continued run would start
    it."""
    from dlrmflow.engine.run_state import load_dense

    dense = load_dense(run.state_dir)
    model_config = config_of(dense["model"], dense["model_config"])
    if (model_config.num_dense, model_config.num_tables) != (len(meta.dense_columns), len(meta.sparse_columns)):
        raise InitFromError(f"{where}'s model reads {model_config.num_dense} dense features and "
                            f"{model_config.num_tables} tables; {dataset_dir} has {len(meta.dense_columns)} and "
                            f"{len(meta.sparse_columns)}")
    cards = parent_cardinalities(run, meta, where)
    embedding = dense["embedding"]
    # The run's own row layout, whatever this version's: scoring reads only the weights. A final state that does
    # not record own_accumulator_columns has the layout before it: one accumulator shared by every weight.
    spec = RowSpec(dim=int(embedding["dim"]), optimizer=embedding["optimizer"], seed=int(run.summary.get("seed", 0)),
                   table_offsets=tuple(meta.table_offsets), cardinalities=tuple(meta.cardinalities),
                   init_std=row_init_std(dense["model"]), earlier_cardinalities=meta.earlier_cardinalities,
                   start=run.starting_rows(cards),
                   own_accumulator_columns=int(embedding.get("own_accumulator_columns", 0)))
    return dense, model_config, cards, spec


def evaluate_run(run_dir: str | os.PathLike, dataset_dir: str | os.PathLike, *, batch_size: int = 4096,
                 device: str = "cpu", client: Client | None = None) -> dict[str, Any]:
    """Score the final model of ``run_dir`` on every row of ``dataset_dir`` (module docstring): with
    ``client``, a part of the rows per Dask task on its workers (:mod:`.cluster_scoring`), else in this
    process; the same bits either way."""
    run = read_finished_run(run_dir, option="RUN_DIR")
    meta = read_meta(dataset_dir)
    dense, model_config, cards, spec = scoring_setup(run, meta, dataset_dir, f"RUN_DIR {run_dir}")
    progress = PhaseProgress("evaluation rows", meta.rows)
    model, device_type = DenseModel(model_config, dense["dense"], spec.dim), torch.device(device).type
    if client is not None:
        summary, lookups = cluster_scoring.score_on_cluster(
            client, dataset_dir, 0, meta.rows, batch_size, model, InitRows(spec), device_type=device_type,
            progress=progress, known_rows=cards)
    else:
        summary, lookups = cluster_scoring.score_parts_in_process(
            dataset_dir, 0, meta.rows, batch_size, model, InitRows(spec), device_type=device_type, progress=progress,
            known_rows=cards)
    rows = summary.rows
    return {
        "run_dir": run.run_dir,
        "dataset": str(dataset_dir),
        "scored_on": "cluster" if client is not None else "process",
        "dataset_fingerprint": meta.fingerprint,
        "model": dense["model"],
        "run_iterations": run.steps,
        "rows": rows,
        "positive_rate": summary.positives / rows if rows else None,
        "auc": summary.auc(),
        "log_loss": summary.log_loss(),
        "constant_log_loss": constant_log_loss(summary.positives, rows),
        "new_ids": int(sum(meta.cardinalities) - sum(cards)),  # rows of this vocabulary the run never had
        "new_id_lookups": lookups,  # lookups (rows x tables) that met such a row
        "new_id_lookup_share": lookups / (rows * len(cards)) if rows else 0.0,
    }
