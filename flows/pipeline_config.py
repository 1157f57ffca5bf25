"""The pipeline's parameters: one validated model, light to import (the CLI builds ``dlrmflow demo``'s
options from it without loading Prefect, Dask or torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from dlrmflow.engine.faults import check_kills
from dlrmflow.engine.train_config import TrainConfig


def training_field(name: str, **overrides: Any) -> Any:
    """TrainConfig's field ``name`` (type, bounds, description), with the pipeline's own default where given."""
    return FieldInfo.merge_field_infos(TrainConfig.model_fields[name], **overrides)


class PipelineConfig(BaseModel):
    """Everything the pipeline needs; the defaults run in a few minutes on 2 cores."""

    model_config = ConfigDict(extra="forbid")

    work_dir: str = Field("runs/demo", description="where the raw data, dataset, plan and runs go")
    raw_inputs: list[str] | None = Field(None, description="raw files to preprocess; none: generate data")
    format: Literal["criteo", "criteo-csv", "avazu"] = "criteo"
    rows: int = Field(500_000, ge=1, description="rows to generate when raw_inputs is empty")
    scale: float = Field(0.05, gt=0, description="table sizes vs Criteo Kaggle, for generated data")
    seed: int = training_field("seed", description="seeds the generated data, the shuffle and the models")
    batch_size: int = training_field("batch_size", default=2048, description="batch size of the plan, the "
                                     "cache comparison and training")
    lookahead: int = Field(200, ge=1, description="L, iterations the oracle cacher looks ahead")
    prefetch_distance: int = Field(2, ge=1, description="P, iterations ahead a fetch is issued (P <= L)")
    cache_fraction: float = Field(0.1, gt=0, le=1, description="cache size (share of rows) to compare policies at")
    train_iterations: int = training_field("iterations", default=100, description="iterations of each training run")
    shards: int = training_field("num_shards")
    parity: int = training_field("parity", default=1, description="parity shards of the oracle-parity run "
                                 "(0: no fault tolerance, and no such run)")
    kills: list[str] = Field(default_factory=list, description="failure injection in the oracle-parity run, "
                             "e.g. shard:0@50 (shard:I@ITER or parity:J@ITER, repeatable)")
    dask_address: str | None = Field(None, description="existing Dask scheduler; none: a LocalCluster")

    @model_validator(mode="after")
    def _fields_agree(self) -> PipelineConfig:
        if self.prefetch_distance > self.lookahead:
            raise ValueError(f"prefetch_distance ({self.prefetch_distance}) must be <= lookahead ({self.lookahead})")
        if self.kills and not self.parity:  # the kills go to the oracle-parity run, which parity 0 leaves out
            raise ValueError("kills need parity >= 1 (without parity a lost shard cannot be rebuilt)")
        check_kills(self.kills, num_shards=self.shards, parity=self.parity, iterations=self.train_iterations)
        return self
