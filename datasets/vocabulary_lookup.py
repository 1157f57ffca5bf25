"""Raw values to a dataset's ids, as ``dlrmflow preprocess --vocabulary DATASET`` gives them:
``dlrmflow.load_vocabulary(DATASET)``.

Raw lines are parsed by the preprocess job's own parser (:func:`~dlrmflow.datasets.formats.parse_block`:
the same validation, dense transform and categorical values), capped by its hash cap when the dataset
has one (``--max-rows-per-table``), and looked up in the dataset's vocabulary files
(:mod:`dlrmflow.datasets.vocabulary`), one partition file at a time. A value the vocabulary holds gets its
id; a missing value gets 0, and so does a value the vocabulary does not hold (one the dataset never saw, or
saw fewer than ``--min-frequency`` times): id 0 is the row preprocess gives a missing or rare value, and
the only row of a trained model such a value can read. Those lookups are counted (``unseen``): preprocess
with ``--vocabulary`` would give a value new to it a new id, which a model trained before has no row for.

Besides a dataset directory, :func:`load_vocabulary` reads the vocabulary an export carries
(``vocabulary.json`` and its files: ``dlrmflow export``, docs/export.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmflow.datasets.formats import RawFormat, get_format, parse_block
from dlrmflow.datasets.meta import META_FILE, DatasetError, read_meta
from dlrmflow.datasets.vocabulary import VocabularyFile, load_parent, read_range

EXPORT_FILE = "vocabulary.json"  # what an export writes beside the vocabulary files (write_vocabulary)


@dataclass(frozen=True)
class EncodedRows:
    """Raw lines as a preprocessed dataset stores them: ``labels`` int8 ``[n]``, ``dense`` float32 ``[n, D]``,
    ``sparse`` ids int32 ``[n, T]``; ``unseen``: lookups of a value the vocabulary does not hold (given id 0);
    ``rejects``: the lines preprocess would reject, ``(line, reason, text)``."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    unseen: int
    rejects: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Vocabulary:
    """A dataset's vocabulary (module docstring): ``format`` its raw format, ``tables`` its categorical
    columns in order, ``cardinalities`` their sizes, ``max_rows_per_table`` its hash cap (None: none)."""

    directory: str
    format: RawFormat
    tables: tuple[str, ...]
    cardinalities: tuple[int, ...]
    max_rows_per_table: int | None
    files: dict[str, list[VocabularyFile]]
    fingerprint: str

    def ids(self, table: str, values: Any) -> np.ndarray:
        """The ids (int32) of one table's values as the format's parser yields them (criteo: the 8 hex
        digits' integer, ``int("68fd1e64", 16)``; avazu: the text), None for a missing value."""
        return self.lookup(table, values)[0]

    def lookup(self, table: str, values: Any) -> tuple[np.ndarray, int]:
        """:meth:`ids` and how many of the values the vocabulary does not hold (missing ones not counted)."""
        from dlrmflow.datasets.preprocess import cap_values  # preprocess's own hash cap

        if table not in self.files:
            raise DatasetError(f"{self.directory} has no categorical table {table!r} (its tables: "
                               f"{', '.join(self.tables[:5])}...)")
        values = values if isinstance(values, pa.Array) else pa.array(list(values))
        values = cap_values(values, self.max_rows_per_table)
        out = np.zeros(len(values), dtype=np.int32)
        found = np.zeros(len(values), dtype=bool)
        if values.type == pa.null():  # every value missing
            return out, 0
        for f in self.files[table]:
            try:
                first, last = pa.scalar(f.first, values.type), pa.scalar(f.last, values.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                raise DatasetError(f"{table}: its vocabulary holds {type(f.first).__name__} values, given "
                                   f"{values.type}") from None
            inside = pc.fill_null(pc.and_(pc.greater_equal(values, first), pc.less_equal(values, last)), False)
            where = np.flatnonzero(inside.to_numpy(zero_copy_only=False))
            if not len(where):
                continue
            known, known_ids = read_range(self.directory, [f], None, None)
            query = values.take(pa.array(where)).cast(known.type)
            at = pc.fill_null(pc.index_in(query, value_set=known), -1).to_numpy(zero_copy_only=False)
            hit = at >= 0
            out[where[hit]] = known_ids[at[hit]]
            found[where[hit]] = True
        present = values.is_valid().to_numpy(zero_copy_only=False)
        return out, int(np.count_nonzero(present & ~found))

    def encode(self, lines: bytes | str | Iterable[bytes | str]) -> EncodedRows:
        """Whole raw lines of the dataset's format (text, or lines as an open file gives them; a header line first
        is skipped) as the dataset's columns."""
        if isinstance(lines, (bytes, str)):
            data = lines.encode() if isinstance(lines, str) else bytes(lines)
        else:
            raw = [line.encode() if isinstance(line, str) else bytes(line) for line in lines]
            data = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in raw)
        if self.format.has_header:
            first, _, rest = data.partition(b"\n")
            if first.rstrip(b"\r").decode(errors="replace") == self.format.header_line:
                data = rest
        parsed = parse_block(data, self.format)
        sparse = np.zeros((len(parsed.labels), len(self.tables)), dtype=np.int32)
        unseen = 0
        for k, (table, values) in enumerate(zip(self.tables, parsed.sparse, strict=True)):
            sparse[:, k], missed = self.lookup(table, values)
            unseen += missed
        return EncodedRows(parsed.labels, parsed.dense, sparse, unseen, parsed.rejects)

    def record(self) -> dict[str, Any]:
        """What ``vocabulary.json`` holds (:func:`write_vocabulary`)."""
        return {"source_format": self.format.name, "tables": list(self.tables),
                "cardinalities": list(self.cardinalities), "max_rows_per_table": self.max_rows_per_table,
                "fingerprint": self.fingerprint,
                "files": {t: [vars(f) for f in fs] for t, fs in self.files.items()}}


def load_vocabulary(directory: str | os.PathLike) -> Vocabulary:
    """The vocabulary of a preprocessed dataset (or of an export: module docstring); DatasetError naming the
    problem when there is none (a dataset written from arrays keeps none)."""
    path = Path(directory)
    if (path / EXPORT_FILE).is_file() and not (path / META_FILE).is_file():
        return _exported(path)
    meta = read_meta(path)
    cap = meta.transform.get("max_rows_per_table")
    parent = load_parent(path, source_format=meta.source_format, max_rows_per_table=cap,
                         sparse_columns=list(meta.sparse_columns))
    return Vocabulary(parent.directory, get_format(meta.source_format), tuple(meta.sparse_columns),
                      tuple(meta.cardinalities), cap, parent.files, meta.fingerprint)


def _exported(path: Path) -> Vocabulary:
    try:
        record = json.loads((path / EXPORT_FILE).read_text())
        files = {t: [VocabularyFile.from_json(f) for f in fs] for t, fs in record["files"].items()}
        vocabulary = Vocabulary(str(path.resolve()), get_format(record["source_format"]), tuple(record["tables"]),
                                tuple(record["cardinalities"]), record["max_rows_per_table"], files,
                                record["fingerprint"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DatasetError(f"{path / EXPORT_FILE} is not a vocabulary record: {type(exc).__name__}: {exc}") from None
    missing = [f.name for fs in files.values() for f in fs if not (path / f.name).is_file()]
    if missing:
        raise DatasetError(f"the vocabulary in {path} is incomplete: missing {', '.join(missing[:3])}")
    return vocabulary


def write_vocabulary(vocabulary: Vocabulary, directory: str | os.PathLike) -> list[str]:
    """Copy ``vocabulary``'s files into ``directory`` under their own names, with ``vocabulary.json``: a
    directory :func:`load_vocabulary` reads. The files written, relative to ``directory``."""
    directory = Path(directory)
    written = []
    for f in (f for fs in vocabulary.files.values() for f in fs):
        (directory / f.name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(vocabulary.directory) / f.name, directory / f.name)
        written.append(f.name)
    (directory / EXPORT_FILE).write_text(json.dumps(vocabulary.record(), indent=2, sort_keys=True) + "\n")
    return [*written, EXPORT_FILE]

