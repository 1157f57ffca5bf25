"""A checked run: :class:`RunSetup`, made once by :func:`prepare_run` before any work starts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrmflow.datasets.meta import DatasetMeta, read_meta
from dlrmflow.engine.batch_stream import BatchStream, batches_ending_by, global_ids
from dlrmflow.engine.models import architecture, first_order_columns, model_config, row_init_std, row_width
from dlrmflow.engine.planning.planner import CapacityError, Plan, load_plan
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.training.checkpoint_format import check_row_layout, load_checkpoint
from dlrmflow.engine.training.config import TrainConfig, TrainConfigError, embedding_optimizer_for
from dlrmflow.engine.training.continuation import FinishedRun, check_init_from, read_finished_run
from dlrmflow.engine.training.faults import Kill, check_kills
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE
from dlrmflow.engine.training.run_directory_checks import check_resumable, refuse_unfinished_run


@dataclass
class RunSetup:
    """A checked configuration: everything resolved before any work starts (:func:`prepare_run`).

    Made once per run and handed down (CLI check, flow, task, :func:`train`) rather than recomputed:
    making it reads the plan and, for a mode whose cache must hold a whole batch, scans every training batch's ids."""

    config: TrainConfig
    meta: DatasetMeta
    stream: BatchStream
    iterations: int
    eval_start: int  # held-out rows [eval_start, meta.rows)
    model_config: Any  # the model's checked architecture (a model module's frozen config dataclass)
    spec: RowSpec
    embedding_optimizer: str  # config.embedding_optimizer resolved (never auto): the row update spec carries out
    plan: Plan | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    kills: list[Kill] = field(default_factory=list)  # the parsed kills
    plan_fingerprint: str | None = None
    resume_at: int | None = None  # resume: the iteration of the checkpoint the run continues from
    init_from: FinishedRun | None = None  # --init-from: the finished run it starts from (spec.start: its rows)
    # Tests only: trainer 0 also gathers the whole final state into its result (``whole_state``), as runs
    # did before each shard wrote its own rows: every row in one process.
    whole_state: bool = False
    # --trainers W > 1: the directory of each iteration's slices and, with a plan, every cached lifetime's
    # holders (slices.prepare_trainers, called by run_trainers).
    trainers_dir: str | None = None
    # Benchmarks only: every LRPP trainer holds every cached row (the baseline of Bagpipe's saving).
    every_trainer_holds_every_row: bool = False

    @property
    def steps_before(self) -> int:
        """Optimizer steps taken before this run's first iteration (--init-from: the finished run's)."""
        return 0 if self.init_from is None else self.init_from.steps


def _max_distinct_rows(stream: BatchStream, iterations: int) -> int:
    """The most distinct embedding rows any of the first ``iterations`` batches uses."""
    ids_only = BatchStream(
        stream.dataset_dir, stream.batch_size, drop_last=stream.drop_last, sparse_only=True
    )
    most = 0
    for batch in ids_only.iter_range(0, iterations):
        most = max(most, len(np.unique(global_ids(batch.sparse, ids_only.offsets))))
    return most


def row_optimizer(embedding_optimizer: str, width: int, first_order: int) -> tuple[str, int]:
    """RowSpec's optimizer and own-accumulator columns for ``--embedding-optimizer``, a row of ``width`` values
    whose last ``first_order`` are a model's first-order weights. ``adagrad-per-value`` is Adagrad where every
    value but the first keeps an accumulator of its own, and the row's shared accumulator serves that first value
    alone: one accumulator per value."""
    if embedding_optimizer == "adagrad-per-value":
        return "adagrad", width - 1
    return embedding_optimizer, first_order


def prepare_run(config: TrainConfig, *, plan=None) -> RunSetup:
    """Check ``config`` (valid by construction) against the dataset, the plan, the device and the run
    directory; resolve the iteration count. Raises a UserInputError whose message names the field.

    ``plan``: an already loaded plan for ``--mode oracle`` (else it is loaded from ``plan_dir``)."""
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise TrainConfigError(f"device: --device {config.device}: no CUDA GPU is available")
    mode = MODES[config.mode]
    if mode.capacity_required and config.capacity is None:
        raise CapacityError(f"capacity: --mode {config.mode} needs --capacity ROWS (>= 1)")
    meta = read_meta(config.dataset_dir)  # DatasetError (a UserInputError) if missing or broken
    architecture_config = model_config(config.model, config, num_dense=len(meta.dense_columns),
                                       num_tables=len(meta.sparse_columns))

    drop_last = False
    if mode.plan:
        if plan is None and not config.plan_dir:
            raise TrainConfigError(f"plan_dir: --mode {config.mode} needs --plan PLAN_DIR (make one with "
                                   "`dlrmflow plan`)")
        if plan is None:
            plan = load_plan(config.plan_dir, dataset_dir=config.dataset_dir, batch_size=config.batch_size)
        if plan.config.batch_size != config.batch_size:
            raise TrainConfigError(f"batch_size: the plan was made for batch size {plan.config.batch_size}, "
                                   f"not --batch-size {config.batch_size}")
        drop_last = bool(plan.config.drop_last)
    elif plan is not None:
        users = " and ".join(name for name, m in MODES.items() if m.plan)
        raise TrainConfigError(f"plan_dir: --plan is only used by --mode {users}, not --mode {config.mode}")

    stream = BatchStream(config.dataset_dir, config.batch_size, drop_last=drop_last)
    eval_rows = int(round(config.eval_fraction * meta.rows))
    eval_start = meta.rows - eval_rows
    if config.eval_fraction > 0 and eval_rows == 0:
        raise TrainConfigError(f"eval_fraction: --eval-fraction {config.eval_fraction} of {meta.rows} rows holds "
                               "out no row")
    fit = batches_ending_by(meta.rows, config.batch_size, eval_start, drop_last=drop_last)
    if fit == 0:
        held_out = f", {eval_rows} of {meta.rows} held out for evaluation" if eval_rows else ""
        raise TrainConfigError(
            f"batch_size: --batch-size {config.batch_size} is larger than the {eval_start} training rows of the "
            f"dataset{held_out}: no whole batch fits (lower --batch-size"
            f"{' or --eval-fraction' if eval_rows else ''})")
    iterations = fit if config.iterations is None else config.iterations
    if iterations > fit:
        raise TrainConfigError(
            f"iterations: --iterations {iterations} is beyond the data: {meta.rows} rows with {eval_rows} held "
            f"out for evaluation leave {fit} batches of {config.batch_size} (lower --iterations, --batch-size "
            "or --eval-fraction)"
        )
    last_lo, last_hi = stream.batch_rows(iterations - 1)
    last_rows = last_hi - last_lo
    if last_rows % config.trainers:  # a partial last batch: each of the W trainers must get as many rows
        raise TrainConfigError(
            f"iterations: the last of the {iterations} batches has {last_rows} rows, which do not split into "
            f"{config.trainers} equal slices (--trainers {config.trainers}); use --iterations {iterations - 1}")
    # InitFromError: not a finished run. Checked against this run once its rows' layout is known (below).
    finished = None if config.init_from is None else read_finished_run(config.init_from)
    embedding_optimizer = embedding_optimizer_for(
        config.embedding_optimizer, config.model, None if finished is None else finished.summary["embedding_optimizer"])
    width = row_width(config.model, config.embedding_dim)
    optimizer, own_accumulators = row_optimizer(embedding_optimizer, width, first_order_columns(config.model))
    spec = RowSpec(
        dim=width,
        optimizer=optimizer,
        seed=config.seed,
        table_offsets=tuple(meta.table_offsets),
        cardinalities=tuple(meta.cardinalities),
        lr=config.embedding_lr if config.embedding_lr is not None else config.lr,
        init_std=row_init_std(config.model),
        earlier_cardinalities=meta.earlier_cardinalities,
        own_accumulator_columns=own_accumulators,
    )
    if finished is not None:  # InitFromError: another model or optimizer, unrelated data
        start = check_init_from(finished, config=config, embedding_optimizer=embedding_optimizer, meta=meta,
                                architecture=architecture(architecture_config), row_width=spec.dim,
                                width=spec.width, layout=spec.describe_layout())
        spec = dataclasses.replace(spec, start=start)
    checks: dict[str, Any] = {}
    if plan is not None:
        if plan.num_iterations < iterations:
            raise TrainConfigError(
                f"iterations: the plan covers {plan.num_iterations} iterations, fewer than --iterations {iterations}"
            )
        if config.capacity is not None and plan.num_slots > config.capacity:
            raise CapacityError(f"capacity: the plan needs a cache of {plan.num_slots} rows, more than --capacity "
                                f"{config.capacity}")
    if mode.capacity_required:
        most = _max_distinct_rows(stream, iterations)  # a pass over the ids only
        checks["max_distinct_rows_per_batch"] = most
        if most > config.capacity:
            raise CapacityError(f"capacity: --capacity {config.capacity} is too small: a batch uses up to {most} "
                                "distinct embedding rows")
    kills = check_kills(config.kills, num_shards=config.num_shards, parity=config.parity, iterations=iterations)
    plan_fp = plan_fingerprint(plan)
    resume_at = None
    if config.resume:  # ResumeError: no checkpoint, a finished run, changed data or plan, another configuration
        resume_at = check_resumable(config.output_dir, config.model_dump(), dataset_fingerprint=meta.fingerprint,
                                    plan_fingerprint=plan_fp, iterations=iterations)
        checkpoint = Path(config.output_dir) / CHECKPOINT_FILE
        check_row_layout(checkpoint, load_checkpoint(checkpoint, mmap=True), spec)  # before any worker starts
    else:
        refuse_unfinished_run(config.output_dir)  # names `dlrmflow resume RUN_DIR`
    return RunSetup(config, meta, stream, iterations, eval_start, architecture_config, spec, embedding_optimizer, plan,
                    checks, kills, plan_fp, resume_at, finished)


def plan_fingerprint(plan) -> str | None:
    """SHA-256 of a plan's plan.json (its dataset, settings, counts and files); None without a plan."""
    info = getattr(plan, "info", None)
    if info is None:
        return None
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()
