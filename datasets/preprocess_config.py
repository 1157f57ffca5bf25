"""The preprocess step, declared once: :class:`PreprocessConfig` (what to read, where to write, how) and
:class:`PreprocessResult` (what it made).

The config is what :func:`dlrmflow.datasets.preprocess.run_preprocess` runs, the preprocess flow's
parameter, the source of the ``dlrmflow preprocess`` options and of the pipeline's ``format``. It
knows when its output is up to date (:meth:`PreprocessConfig.saved_result`): ``meta.json`` holds the
fingerprint of the same inputs (path, size, modification time) and parameters.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from dlrmflow.datasets.formats import FORMATS
from dlrmflow.datasets.meta import META_FILE, DatasetMeta, read_meta
from dlrmflow.engine.config_model import ConfigModel
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.up_to_date import file_identity, fingerprint, saved_result

FORMAT_NAMES = tuple(FORMATS)
FINGERPRINT_VERSION = 1  # of meta.json's fingerprint: a new version makes every dataset stale


class PreprocessConfigError(UserInputError):
    """A preprocessing setting is invalid; the message names the field and its option."""


class PreprocessConfig(ConfigModel):
    """One preprocessing run. ``PreprocessConfig(**values)`` raises :class:`PreprocessConfigError` naming
    every invalid field (``min_frequency: --min-frequency must be >= 1, got 0``)."""

    error = PreprocessConfigError
    setting = "preprocessing setting"
    option_names = {"inputs": "INPUT"}

    inputs: list[str] = Field(min_length=1, description="raw input files (plain or .gz)")
    output: str = Field(description="the dataset directory to write")
    format: Literal[FORMAT_NAMES] = Field(
        "criteo", description="criteo: raw TSV (Kaggle/Terabyte); criteo-csv: CSV with header; avazu: CSV")
    seed: int = Field(0, description="shuffle seed")
    min_frequency: int = Field(1, ge=1, description="categorical values seen fewer times map to id 0; 1 keeps all")
    max_rows_per_table: int | None = Field(
        None, ge=2, description="hash cap: fold raw values into this many rows per table (row 0, missing or rare, "
                                "included)")
    max_reject_fraction: float = Field(
        0.01, ge=0, le=1, description="fail when more than this fraction of rows is malformed")
    vocabulary: str | None = Field(
        None, description="a dataset made earlier (e.g. yesterday's) whose ids to keep: its values keep their ids, "
                          "new values take the next ones (by frequency, ties by value), so tables only grow")
    block_bytes: int = Field(
        64 << 20, ge=1024, description="bytes of raw text per parse task (it fixes the pieces, so the dataset "
                                       "depends on it; it never depends on the number of workers)")

    @field_validator("inputs", "output", "vocabulary", mode="before")
    @classmethod
    def _paths_as_text(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def params(self) -> dict[str, Any]:
        """The parameters the dataset's fingerprint covers (keyed as meta.json's fingerprint has always had them)."""
        return {"fmt": self.format, "seed": self.seed, "min_frequency": self.min_frequency,
                "max_rows_per_table": self.max_rows_per_table, "max_reject_fraction": self.max_reject_fraction,
                "block_bytes": self.block_bytes}

    def fingerprint(self, identity: list[dict[str, Any]] | None = None) -> str:
        """The dataset's key (``meta.json``'s ``fingerprint``): the inputs' identity
        (:func:`~dlrmflow.engine.up_to_date.file_identity`, computed when not given) and :meth:`params`."""
        identity = file_identity(self.inputs) if identity is None else identity
        key: dict[str, Any] = {"version": FINGERPRINT_VERSION, "inputs": identity, "params": self.params()}
        if self.vocabulary is not None:  # the parent's ids are part of the result
            key["vocabulary"] = self.parent_fingerprint()
        return fingerprint(key)

    def parent_fingerprint(self) -> str | None:
        """The fingerprint of the --vocabulary dataset (None when it has no readable meta.json)."""
        try:
            return read_meta(Path(self.vocabulary)).fingerprint
        except UserInputError:
            return None

    def saved_result(self) -> PreprocessResult | None:
        """The dataset at ``output`` (as a skipped result) when it was made from these inputs, unchanged, with
        these parameters, and is complete; None when the step must run."""
        output = Path(self.output).resolve()
        try:
            key = self.fingerprint()
        except OSError:  # an input is missing or unreadable: nothing is up to date
            return None
        if saved_result(output / META_FILE, {"fingerprint": key}) is None:
            return None
        try:
            meta = read_meta(output)
        except UserInputError:  # made from the same inputs, but incomplete: made again
            return None
        return PreprocessResult.of(meta, output, skipped=True, seconds=0.0)

    def is_up_to_date(self) -> bool:
        return self.saved_result() is not None


@dataclass(frozen=True)
class PreprocessResult:
    """What a preprocessing run made (or found up to date); :meth:`as_dict` is `dlrmflow preprocess --json`."""

    dataset: str
    skipped: bool
    format: str
    rows: int
    rejected_rows: int
    rejected_by_reason: dict[str, int]
    rejected_file: str | None
    tables: int
    cardinalities: list[int]
    embedding_rows: int
    files: int
    fingerprint: str
    seconds: float
    rows_per_second: int | None

    @classmethod
    def of(cls, meta: DatasetMeta, output: str | os.PathLike, *, skipped: bool, seconds: float) -> PreprocessResult:
        output = Path(output)
        return cls(
            dataset=str(output), skipped=skipped, format=meta.source_format, rows=meta.rows,
            rejected_rows=meta.rejected_rows, rejected_by_reason=meta.rejected_by_reason,
            rejected_file=str(output / "rejected" / "rejected.csv") if meta.rejected_rows else None,
            tables=len(meta.cardinalities), cardinalities=meta.cardinalities,
            embedding_rows=meta.total_embedding_rows, files=len(meta.files), fingerprint=meta.fingerprint,
            seconds=round(seconds, 3),
            rows_per_second=round(meta.rows / seconds) if seconds > 0 and not skipped else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
