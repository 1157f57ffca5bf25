"""The daily loop's parameters: one validated model, light to import (``dlrmflow daily`` builds its options
from it without loading Prefect, Dask or torch); the ``config`` parameter of the ``daily/nightly``
deployment. Its training fields take their type, default and help from ``TrainConfig`` and ``PlanConfig``.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlrmflow.datasets.preprocess_config import FORMAT_NAMES, PreprocessConfig
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.planning.planner import PlanConfig
from dlrmflow.engine.training.config import MODELS
from dlrmflow.flows.pipeline_config import _problems, field_of, training_field


class DailyConfigError(UserInputError):
    """The daily loop's parameters are invalid; the message names the field."""


class DailyConfig(BaseModel):
    """A landing directory of day files and a state directory; how each day is prepared and trained."""

    model_config = ConfigDict(extra="forbid")

    landing: str = Field(description="the day files: a directory (every file in it but hidden and .json ones) "
                         "or a glob; days are taken in the natural order of their names (day_2 before day_10)")
    state_dir: str = Field(description="where each day's dataset, plan and run, and the history, go")
    format: Literal[FORMAT_NAMES] = field_of(PreprocessConfig, "format")
    min_frequency: int = field_of(PreprocessConfig, "min_frequency")
    max_rows_per_table: int | None = field_of(PreprocessConfig, "max_rows_per_table")
    seed: int = training_field("seed", description="seeds the shuffle and the model's first day")
    model: Literal[MODELS] = training_field("model")
    embedding_dim: int = training_field("embedding_dim")
    batch_size: int = training_field("batch_size", default=2048, description="batch size of the plans and training")
    lookahead: int = field_of(PlanConfig, "lookahead")
    prefetch_distance: int = field_of(PlanConfig, "prefetch_distance", default=2)
    shards: int = training_field("num_shards")
    parity: int = training_field("parity", default=1, description="parity shards of each day's training")
    lr: float = training_field("lr")
    dask_address: str | None = Field(None, description="existing Dask scheduler; none: a LocalCluster")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise DailyConfigError(f"invalid daily parameters: {_problems(exc)}") from None
        if self.prefetch_distance > self.lookahead:
            raise DailyConfigError(f"prefetch_distance: {self.prefetch_distance} must be <= lookahead "
                                   f"({self.lookahead})")

    def day_files(self) -> list[Path]:
        """The landing's files in natural name order; DailyConfigError when the landing does not exist."""
        landing = Path(self.landing)
        if landing.is_dir():
            # Not hidden files, nor metadata beside the data (dlrmflow generate's FILE.params.json).
            files = [p for p in landing.iterdir()
                     if p.is_file() and not p.name.startswith(".") and p.suffix != ".json"]
        elif any(c in self.landing for c in "*?["):
            files = [Path(p) for p in glob.glob(self.landing) if Path(p).is_file()]
        elif landing.exists():
            raise DailyConfigError(f"landing: {self.landing} is a file; give its directory or a glob")
        else:
            raise DailyConfigError(f"landing: {self.landing} does not exist")
        files = sorted(files, key=lambda p: natural_key(p.name))
        seen: dict[str, Path] = {}
        for path in files:
            if day_name(path) in seen:
                raise DailyConfigError(f"landing: {seen[day_name(path)].name} and {path.name} are both day "
                                       f"{day_name(path)!r}; keep one file per day")
            seen[day_name(path)] = path
        return files


def natural_key(name: str) -> list[Any]:
    """``day_2`` before ``day_10``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


RAW_SUFFIXES = (".gz", ".tsv", ".csv", ".txt")


def day_name(path: Path) -> str:
    """A day's name (its directory in the state dir): the file name without raw-data extensions
    (``day_0.tsv.gz`` -> ``day_0``; Criteo Terabyte's ``day_0`` has none)."""
    name = path.name
    while Path(name).suffix in RAW_SUFFIXES and Path(name).stem:
        name = Path(name).stem
    return name
