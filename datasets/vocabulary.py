"""A dataset's vocabulary on disk: per categorical table, every kept raw value with its id.

The preprocess job writes it as it gives the ids, one file per vocabulary partition (a value range),
``vocabulary/<table>-p<NNNNN>.arrow`` with columns ``value`` (ascending) and ``id``; ``meta.json``'s
``vocabulary`` lists each table's files with their first and last values. No process ever reads a whole
table: :func:`read_range` reads the values of one range from the files that overlap it.

``dlrmflow preprocess --vocabulary PREVIOUS`` reads it to keep every id of the previous dataset (the
daily loop: the same raw value keeps its id day after day, and new values take the next ids).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmflow.datasets.meta import DatasetError, DatasetMeta, read_meta

VOCABULARY_DIR = "vocabulary"


@dataclass(frozen=True)
class VocabularyFile:
    """One partition's file: ``name`` relative to the dataset, its first and last value, how many."""

    name: str
    first: Any
    last: Any
    values: int

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> VocabularyFile:
        return cls(**obj)


@dataclass(frozen=True)
class ParentVocabulary:
    """The vocabulary a preprocess run keeps: its dataset directory, meta and files per table."""

    directory: str
    fingerprint: str
    cardinalities: list[int]
    files: dict[str, list[VocabularyFile]]
    # Every dataset the new one's ids descend from, oldest first, this parent last (:func:`lineage_entry`).
    lineage: list[dict[str, Any]]

    @property
    def record(self) -> dict[str, str]:
        """What the new dataset's meta.json says of its parent."""
        return {"dataset": self.directory, "fingerprint": self.fingerprint}

    def processed_inputs(self) -> dict[str, str]:
        """Input path -> the dataset of the lineage that already holds its rows."""
        return {path: entry["dataset"] for entry in self.lineage for path in entry["inputs"]}


def lineage_entry(directory: str, meta: DatasetMeta) -> dict[str, Any]:
    """One generation of a growing vocabulary: the dataset, its fingerprint, its tables' sizes (the layout
    its rows were initialised in, :mod:`dlrmflow.engine.serving.embedding_rows`), its input files and their
    content digests."""
    return {"dataset": directory, "fingerprint": meta.fingerprint, "cardinalities": list(meta.cardinalities),
            "inputs": [str(i["path"]) for i in meta.inputs],
            "digests": list((meta.extra or {}).get("input_digests", {}).values())}


def lineage(meta: DatasetMeta) -> list[dict[str, Any]]:
    """The datasets ``meta``'s ids descend from, oldest first (empty: a vocabulary of its own)."""
    return list((meta.vocabulary or {}).get("lineage") or [])


def write_partition(dataset_dir: str | os.PathLike, table: str, index: int, values: pa.Array,
                    ids: np.ndarray) -> VocabularyFile | None:
    """Write one partition's (value, id) pairs in value order; None when it holds no value."""
    if len(values) == 0:
        return None
    order = value_order(values)
    values, ids = values.take(pa.array(order)), ids[order]
    name = f"{VOCABULARY_DIR}/{table}-p{index:05d}.arrow"
    path = Path(dataset_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    table_ = pa.table({"value": values, "id": pa.array(ids.astype(np.int32))})
    with ipc.new_file(path, table_.schema) as writer:
        writer.write_table(table_)
    return VocabularyFile(name, values[0].as_py(), values[-1].as_py(), len(values))


def value_order(values: pa.Array) -> np.ndarray:
    """The positions of ``values`` in ascending value order (NumPy sorts integers several times faster
    than Arrow)."""
    if pa.types.is_integer(values.type):
        return np.argsort(values.to_numpy(), kind="stable")
    import pyarrow.compute as pc

    return pc.sort_indices(values).to_numpy()


def value_range(values: pa.Array, lo: Any, hi: Any) -> tuple[int, int]:
    """The positions [a, b) of the values in [lo, hi) (None: unbounded) within ascending ``values``."""
    if lo is None and hi is None:
        return 0, len(values)
    arr = values.to_numpy(zero_copy_only=False)
    a = 0 if lo is None else int(np.searchsorted(arr, lo, side="left"))
    b = len(arr) if hi is None else int(np.searchsorted(arr, hi, side="left"))
    return a, b


def read_range(dataset_dir: str, files: list[VocabularyFile], lo: Any, hi: Any) -> tuple[pa.Array | None, np.ndarray]:
    """The (values ascending, ids) of a table's vocabulary in [lo, hi) (None: unbounded), from the files
    that overlap the range only. (None, empty) when none does."""
    values, ids = [], []
    for f in files:
        if (lo is not None and f.last < lo) or (hi is not None and f.first >= hi):
            continue
        with pa.memory_map(str(Path(dataset_dir) / f.name)) as source:
            t = ipc.open_file(source).read_all()
        v = t["value"].combine_chunks()
        a, b = value_range(v, lo, hi)
        values.append(v.slice(a, b - a))
        ids.append(t["id"].to_numpy()[a:b])
    if not values:
        return None, np.zeros(0, np.int64)
    return pa.concat_arrays(values), np.concatenate(ids).astype(np.int64)


def vocabulary_record(files: dict[str, list[VocabularyFile]], parent: ParentVocabulary | None) -> dict[str, Any]:
    """meta.json's ``vocabulary``."""
    return {"tables": {t: [asdict(f) for f in fs] for t, fs in files.items()},
            "parent": parent.record if parent else None, "lineage": parent.lineage if parent else []}


def load_parent(directory: str | os.PathLike, *, source_format: str, max_rows_per_table: int | None,
                sparse_columns: list[str] | None = None) -> ParentVocabulary:
    """The vocabulary of the dataset at ``directory`` for a run of ``source_format`` with that hash cap;
    a DatasetError naming the problem when it cannot serve as one."""
    path = Path(directory).resolve()
    where = f"--vocabulary {str(directory)!r}"
    try:
        meta: DatasetMeta = read_meta(path)
    except DatasetError as exc:
        raise DatasetError(f"{where}: {exc}") from None
    if meta.vocabulary is None:
        raise DatasetError(f"{where} keeps no vocabulary (it was written from arrays, not by `dlrmflow "
                           "preprocess`): only a preprocessed dataset serves as a vocabulary")
    if meta.source_format != source_format:
        raise DatasetError(f"{where} was preprocessed as --format {meta.source_format!r}, this run is "
                           f"--format {source_format!r}")
    if sparse_columns is not None and list(meta.sparse_columns) != list(sparse_columns):
        raise DatasetError(f"{where} has {len(meta.sparse_columns)} categorical tables "
                           f"({', '.join(meta.sparse_columns[:3])}...), this run has {len(sparse_columns)}")
    cap = meta.transform.get("max_rows_per_table")
    if cap != max_rows_per_table:
        raise DatasetError(f"{where} was preprocessed with --max-rows-per-table {cap}, this run has "
                           f"{max_rows_per_table}: a capped table's rows are hash buckets of that cap")
    tables = meta.vocabulary["tables"]
    files = {t: [VocabularyFile.from_json(f) for f in tables.get(t, [])] for t in meta.sparse_columns}
    missing = [f.name for fs in files.values() for f in fs if not (path / f.name).is_file()]
    if missing:
        raise DatasetError(f"{where} is incomplete: missing {', '.join(missing[:3])}")
    return ParentVocabulary(str(path), meta.fingerprint, list(meta.cardinalities), files,
                            [*lineage(meta), lineage_entry(str(path), meta)])


def refuse_processed_inputs(paths: list[Path], parent: ParentVocabulary) -> None:
    """A day file whose rows a dataset of the vocabulary's lineage already holds would be trained on twice:
    a DatasetError naming it, found by its path or, for a copy under another name, by its content
    (:func:`content_digest`). Preprocessing the parent's own inputs again is allowed (it gives the parent's
    ids: the same dataset)."""
    if {str(p) for p in paths} == set(parent.lineage[-1]["inputs"]):
        return
    done = parent.processed_inputs()
    by_content = {digest: entry for entry in parent.lineage for digest in entry.get("digests", [])}
    for path in paths:
        if str(path) in done:
            raise DatasetError(f"{path} was already preprocessed into {done[str(path)]} (an ancestor of "
                               f"--vocabulary {parent.directory}): its rows would be trained on twice")
        same = by_content.get(content_digest(path))
        if same is not None:
            raise DatasetError(f"{path} has the content of a file already preprocessed into {same['dataset']} "
                               f"(an ancestor of --vocabulary {parent.directory}): its rows would be trained on twice")


DIGEST_SPAN = 1 << 20  # bytes read at each end of a file for its content digest


def content_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's size and its first and last MiB: tells a day file copied under another name from
    every other day's file without reading it all (day files of one size and equal ends do not occur)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode())
        digest.update(f.read(DIGEST_SPAN))
        if size > DIGEST_SPAN:
            f.seek(max(DIGEST_SPAN, size - DIGEST_SPAN))
            digest.update(f.read(DIGEST_SPAN))
    return digest.hexdigest()
