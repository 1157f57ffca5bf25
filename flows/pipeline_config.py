"""The pipeline's parameters: one validated model, light to import (the CLI builds ``dlrmflow demo``'s
options from it without loading Prefect, Dask or torch). Its fields of a step take their type, default,
bounds and help from that step's config model (:func:`field_of`): training's from ``TrainConfig``, the
plan's from ``PlanConfig``, ``format`` from ``PreprocessConfig``; a pipeline default that differs says so.

Constructing a :class:`PipelineConfig` checks everything that can be checked before any work: each
field's type and bounds, and the rules between fields (the training runs fit in the generated rows,
the kills name shards and iterations that exist, P <= L). A problem raises
:class:`PipelineConfigError` (a ``UserInputError``: the CLI prints one line and exits 2) naming the
config's fields (``train_iterations``, ``rows``, ...), never a command-line option, because the
same model is the ``config`` parameter of the ``pipeline/demo`` deployment. Rows read from
``raw_inputs`` are known only after preprocessing: the pipeline calls :meth:`check_rows` then.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from dlrmflow.datasets.preprocess_config import FORMAT_NAMES, PreprocessConfig
from dlrmflow.engine.batch_stream import batches_ending_by
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.planning.planner import PlanConfig
from dlrmflow.engine.training.config import MODELS, TrainConfig
from dlrmflow.engine.training.faults import KILL_SYNTAX, KillNames, check_kills

# The share of a dataset's rows every training run of the pipeline holds out for evaluation.
EVAL_FRACTION: float = TrainConfig.default("eval_fraction")
# A kill's errors name the pipeline's fields, never train's options.
KILL_NAMES = KillNames(kill="", shard="shards", parity="parity", iterations="train_iterations")


class PipelineConfigError(UserInputError):
    """The pipeline's parameters are invalid or do not fit the data; the message names the fields."""


def training_batches(rows: int, batch_size: int, eval_fraction: float = EVAL_FRACTION) -> int:
    """Whole batches a training run of a ``rows``-row dataset has before its held-out rows.

    The rule of ``engine/training/job.py``'s ``prepare_run``: the last ``round(eval_fraction * rows)`` rows
    are held out, and a batch counts when it ends at or before them (:func:`batches_ending_by`)."""
    return batches_ending_by(rows, batch_size, rows - int(round(eval_fraction * rows)))


def field_of(model: type[BaseModel], name: str, **overrides: Any) -> Any:
    """``model``'s field ``name`` (type, default, bounds, description), with the pipeline's own default or
    description where given."""
    return FieldInfo.merge_field_infos(model.model_fields[name], **overrides)


def training_field(name: str, **overrides: Any) -> Any:
    """TrainConfig's field ``name``, with the pipeline's own default where given."""
    return field_of(TrainConfig, name, **overrides)


class PipelineConfig(BaseModel):
    """Everything the pipeline needs; the defaults run in a few minutes on 2 cores."""

    model_config = ConfigDict(extra="forbid")

    work_dir: str = Field("runs/demo", description="where the raw data, dataset, plan and runs go")
    raw_inputs: list[str] | None = Field(None, description="raw files to preprocess; none: generate data")
    format: Literal[FORMAT_NAMES] = field_of(PreprocessConfig, "format")  # of raw_inputs
    rows: int = Field(500_000, ge=1, description="rows to generate when raw_inputs is empty")
    scale: float = Field(0.05, gt=0, description="table sizes vs Criteo Kaggle, for generated data")
    seed: int = training_field("seed", description="seeds the generated data, the shuffle and the models")
    model: Literal[MODELS] = training_field("model", description="the model every training run trains")
    batch_size: int = training_field("batch_size", default=2048, description="batch size of the plan, the "
                                     "cache comparison and training")
    lookahead: int = field_of(PlanConfig, "lookahead")
    prefetch_distance: int = field_of(PlanConfig, "prefetch_distance", default=2)
    cache_fraction: float = Field(0.1, gt=0, le=1, description="cache size (share of rows) to compare policies at")
    train_iterations: int = training_field("iterations", default=100, description="iterations of each training run")
    shards: int = training_field("num_shards")
    trainers: int = training_field("trainers", description="data-parallel trainers of the remote and oracle runs "
                                   "(oracle: Bagpipe's LRPP cache), parity's included")
    parity: int = training_field("parity", default=1, description="parity shards of the oracle-parity run "
                                 "(0: no fault tolerance, and no such run)")
    kills: list[str] = Field(default_factory=list, description="failure injection in the oracle-parity run, "
                             f"e.g. shard:0@50 ({KILL_SYNTAX}, repeatable)")
    link_rate: int = Field(20, ge=0, le=100_000, description="Mbit/s of the emulated network link (a network "
                           "namespace and tbf; needs root or CAP_NET_ADMIN) that remote and oracle train again "
                           "behind; 0: no such runs")
    dask_address: str | None = Field(None, description="existing Dask scheduler; none: a LocalCluster")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise PipelineConfigError(f"invalid pipeline parameters: {_problems(exc)}") from None

    @model_validator(mode="after")
    def _fields_agree(self) -> PipelineConfig:
        """The rules between fields; each error starts with the field it is about."""
        if self.prefetch_distance > self.lookahead:
            raise PipelineConfigError(f"prefetch_distance: {self.prefetch_distance} must be <= lookahead "
                                      f"({self.lookahead})")
        if self.batch_size % self.trainers:
            raise PipelineConfigError(f"trainers: batch_size {self.batch_size} does not split into {self.trainers} "
                                      "equal slices; use a multiple of trainers")
        self._check_kills()
        if not self.raw_inputs:
            self.check_rows(self.rows)
        return self

    def _check_kills(self) -> None:
        if self.kills and not self.parity:  # the kills go to the oracle-parity run, which parity 0 leaves out
            raise PipelineConfigError("kills need parity >= 1 (without parity a lost shard cannot be rebuilt)")
        # The training run's own rule (so that none of its runs fails later), naming the pipeline's fields.
        check_kills(self.kills, num_shards=self.shards, parity=self.parity, iterations=self.train_iterations,
                    names=KILL_NAMES)

    def check_rows(self, rows: int) -> None:
        """Raise :class:`PipelineConfigError` unless ``train_iterations`` batches of ``batch_size`` fit in a
        dataset of ``rows`` rows (generated: ``rows``; else preprocessed ``raw_inputs``) before its
        held-out rows, as every training run of the pipeline needs."""
        source = f"raw_inputs ({rows:,} rows once preprocessed)" if self.raw_inputs else f"rows {rows:,}"
        held_out = int(round(EVAL_FRACTION * rows))
        fit = training_batches(rows, self.batch_size)
        if held_out == 0:
            raise PipelineConfigError(f"{'raw_inputs' if self.raw_inputs else 'rows'}: {rows:,} rows are too few "
                                      f"to hold out {EVAL_FRACTION:.0%} for evaluation")
        if self.train_iterations > fit:
            raise PipelineConfigError(
                f"train_iterations: {self.train_iterations} batches of batch_size {self.batch_size} need "
                f"{self.train_iterations * self.batch_size:,} training rows, but {source} leave "
                f"{rows - held_out:,} after the {EVAL_FRACTION:.0%} held out for evaluation ({fit} batches): "
                f"lower train_iterations or batch_size, or give more rows")


def _problems(exc: ValidationError) -> str:
    """One ``field: problem`` part per error of ``exc``; a rule's own message as it is."""
    parts = []
    for error in exc.errors():
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, UserInputError):  # a rule's own message (the kill rule's too), naming the fields
            parts.append(str(cause))
            continue
        field = ".".join(str(part) for part in error["loc"]) or "config"
        message = error["msg"]
        parts.append(f"{field}: {message[:1].lower()}{message[1:]}, got {error.get('input')!r}")
    return "; ".join(parts)
