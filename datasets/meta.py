"""The on-disk layout of a preprocessed dataset and its ``meta.json``.

A dataset directory holds::

    part-00000.parquet ...   rows, already shuffled; read them in the order meta.files lists
    meta.json                this file's contents (DatasetMeta)
    rejected/                rejected.csv: every input row that was quarantined, with reason
    vocabulary/              each table's (raw value, id) pairs, by value range (datasets/vocabulary.py)
    profile.json, *.png      written later by the profile flow

Parquet columns: ``label`` int8 (0/1), one float32 column per dense feature
(log(max(x, 0) + 1), missing -> 0), one int32 column per categorical feature holding
contiguous ids ``0 .. cardinality-1`` ordered by frequency (0 = missing or rare).

Everything downstream (profile, planner, trainer) reads a dataset through
:func:`read_meta`, which refuses directories that are incomplete or of another version.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlrmflow.engine.errors import UserInputError

# Rows per Parquet row group of a dataset's files: a reader reads the row groups that hold the rows it wants
# (engine/batch_stream.py), so this bounds what one read holds.
ROW_GROUP_ROWS = 1 << 16

FORMAT_VERSION = 1
META_FILE = "meta.json"


class DatasetError(UserInputError):
    """A dataset directory is missing, incomplete or inconsistent."""


@dataclass(frozen=True)
class PartFile:
    name: str
    rows: int


@dataclass(frozen=True)
class DatasetMeta:
    source_format: str
    rows: int
    label_column: str
    dense_columns: list[str]
    sparse_columns: list[str]
    cardinalities: list[int]
    files: list[PartFile]
    rejected_rows: int
    rejected_by_reason: dict[str, int]
    transform: dict[str, Any]
    inputs: list[dict[str, Any]]
    fingerprint: str
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # Its files per table and the dataset whose ids it kept (datasets/vocabulary.py); None: written from arrays
    # (datasets/writer.py), which keeps no vocabulary.
    vocabulary: dict[str, Any] | None = None

    @property
    def table_offsets(self) -> list[int]:
        """Global id of row 0 of each table: table k's row r has global id offsets[k] + r."""
        offsets, total = [], 0
        for card in self.cardinalities:
            offsets.append(total)
            total += card
        return offsets

    @property
    def total_embedding_rows(self) -> int:
        return sum(self.cardinalities)

    @property
    def earlier_cardinalities(self) -> tuple[tuple[int, ...], ...]:
        """The table sizes of the datasets this one's vocabulary grew from, oldest first (the layouts its
        rows were first initialised in: dlrmflow.engine.serving.embedding_rows)."""
        entries = (self.vocabulary or {}).get("lineage") or []
        return tuple(tuple(int(c) for c in e["cardinalities"]) for e in entries)

    def descends_from(self, fingerprint: str) -> bool:
        """This dataset is the one of ``fingerprint`` or its vocabulary grew from it (its ids keep that one's)."""
        entries = (self.vocabulary or {}).get("lineage") or []
        return fingerprint == self.fingerprint or any(e["fingerprint"] == fingerprint for e in entries)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DatasetMeta:
        obj = dict(obj)
        obj["files"] = [PartFile(**f) for f in obj["files"]]
        return cls(**obj)


def write_meta(directory: str | os.PathLike, meta: DatasetMeta) -> None:
    path = Path(directory) / META_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def read_meta(directory: str | os.PathLike) -> DatasetMeta:
    """Load and check a dataset's meta.json; raise DatasetError naming what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DatasetError(f"dataset directory {str(directory)!r} does not exist")
    path = directory / META_FILE
    if not path.is_file():
        raise DatasetError(
            f"{str(directory)!r} is not a dlrmflow dataset: {META_FILE} is missing "
            "(run `dlrmflow preprocess` to create one)"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path} is not valid JSON: {exc}") from exc
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(
            f"{path} has format_version {version!r}; this dlrmflow reads version {FORMAT_VERSION}"
        )
    try:
        meta = DatasetMeta.from_json(raw)
    except TypeError as exc:
        raise DatasetError(f"{path} does not match the dataset schema: {exc}") from exc
    missing = [f.name for f in meta.files if not (directory / f.name).is_file()]
    if missing:
        raise DatasetError(f"dataset {str(directory)!r} is incomplete: missing {', '.join(missing)}")
    if len(meta.cardinalities) != len(meta.sparse_columns):
        raise DatasetError(f"{path}: {len(meta.cardinalities)} cardinalities for "
                           f"{len(meta.sparse_columns)} categorical columns")
    if sum(f.rows for f in meta.files) != meta.rows:
        raise DatasetError(f"{path}: part files hold {sum(f.rows for f in meta.files)} rows, meta says {meta.rows}")
    return meta
