"""The skew profile of a dataset: how concentrated embedding accesses are.

Every row of every table is an embedding row. Its access count is how many samples use it.
Sorting all rows of all tables by count, the *coverage curve* gives the share of all
accesses taken by the hottest fraction of rows; ``top1pct_share`` is its value at 1% (the
Bagpipe paper reports >92% on Criteo). Counting runs one Dask task per table (per id range of a
table larger than ``ROWS_PER_TASK``), each reading only its column from the Parquet parts.

Every figure comes from the histogram of counts (how many rows have each count), which is exact
and avoids sorting tens of millions of counts. A task counts every row of its range over all the
files, so each row's count is whole there, and sends back only the histogram: the histograms of
disjoint rows add up exactly, and the driver never holds a count per row.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from pydantic import Field, field_validator

from dlrmflow.datasets.meta import DatasetMeta, read_meta
from dlrmflow.engine.config_model import ConfigModel
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.up_to_date import saved_result

PROFILE_FILE = "profile.json"
PLOT_FILE = "coverage.png"


class ProfileConfigError(UserInputError):
    """A profile setting is invalid."""


class ProfileConfig(ConfigModel):
    """One profile of a dataset (the profile flow's parameter, ``dlrmflow profile``'s options). Up to date
    (:meth:`saved_result`) when the dataset's ``profile.json`` records the dataset's fingerprint."""

    error = ProfileConfigError
    setting = "profile setting"
    option_names = {"dataset_dir": "DATASET_DIR"}

    dataset_dir: str = Field(description="a preprocessed dataset directory")

    @field_validator("dataset_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def saved_result(self) -> ProfileResult | None:
        """The dataset's profile (as a skipped result) when it was made of the dataset as it is now, else None."""
        try:
            dataset_fingerprint = read_meta(self.dataset_dir).fingerprint
        except UserInputError:
            return None
        saved = saved_result(Path(self.dataset_dir) / PROFILE_FILE, {"fingerprint": dataset_fingerprint})
        return None if saved is None else ProfileResult.of(saved, skipped=True)

    def is_up_to_date(self) -> bool:
        return self.saved_result() is not None


@dataclass(frozen=True)
class ProfileResult:
    """A dataset's skew profile (``profile.json``, :func:`build_profile`), with the plot when one was drawn;
    :meth:`as_dict` is what ``profile.json`` holds and ``dlrmflow profile --json`` prints."""

    dataset: str
    fingerprint: str
    samples: int
    total_rows: int
    touched_rows: int
    accesses: int
    top1pct_rows: int
    top1pct_share: float
    top01pct_share: float  # "top0.1pct_share" in profile.json
    top10pct_share: float
    tables: list[dict[str, Any]]
    coverage: dict[str, list[float]]
    plot: str | None = None
    skipped: bool = False  # an earlier profile, up to date

    @classmethod
    def of(cls, profile: dict[str, Any], **extra: Any) -> ProfileResult:
        """From a profile dict (:func:`build_profile`, ``profile.json``); ``extra``: plot, skipped."""
        values = {("top01pct_share" if key == "top0.1pct_share" else key): value for key, value in profile.items()}
        values.pop("plot", None)
        values.pop("skipped", None)
        return cls(**values, **extra)

    def as_dict(self, *, coverage: bool = True) -> dict[str, Any]:
        out = {("top0.1pct_share" if f.name == "top01pct_share" else f.name): getattr(self, f.name)
               for f in fields(self)}
        if not coverage:  # the curve is in profile.json: kept out of a short report
            del out["coverage"]
        return out


# A profile task counts at most this many rows of one table (8 bytes each, and as much again while a file's
# counts are added): a larger table is counted in id ranges of this size, each task reading its column again.
ROWS_PER_TASK = 1 << 24
# Counts below this are tallied with one bincount; the few rows with more accesses (at most accesses / this
# many) are sorted: a histogram never allocates an entry per possible count.
_DENSE_COUNTS = 1 << 16


def count_rows(dataset_dir: str, files: list[str], column: str, lo: int, hi: int, cardinality: int) -> np.ndarray:
    """Access count of rows ``lo .. hi-1`` of one table (int64 [hi - lo]), over every file."""
    counts = np.zeros(hi - lo, dtype=np.int64)
    part = lo > 0 or hi < cardinality
    for name in files:
        ids = pq.read_table(Path(dataset_dir) / name, columns=[column]).column(0).to_numpy()
        if part:
            ids = ids[(ids >= lo) & (ids < hi)] - lo
        counts += np.bincount(ids, minlength=hi - lo)[: hi - lo]
    return counts


def count_table(dataset_dir: str, files: list[str], column: str, lo: int, hi: int, cardinality: int) -> CountHistogram:
    """One profile task: rows ``lo .. hi-1`` of a table grouped by access count. Only this histogram leaves the
    task: the report's figures need no more, and the histograms of a table's ranges, and of the tables, add
    up exactly."""
    return CountHistogram(count_rows(dataset_dir, files, column, lo, hi, cardinality))


def count_tasks(meta: DatasetMeta) -> list[tuple[int, int, int]]:
    """``(table, lo, hi)`` of every profile task: each table's rows in ranges of at most ``ROWS_PER_TASK`` (a
    table without rows in one empty range, so that every table has its histogram)."""
    return [(k, lo, min(lo + ROWS_PER_TASK, card))
            for k, card in enumerate(meta.cardinalities) for lo in range(0, max(card, 1), ROWS_PER_TASK)]


class CountHistogram:
    """Rows grouped by access count, hottest first: ``levels[i]`` rows have ``counts[i]`` each.

    Its size is the number of distinct counts (at most about ``sqrt(2 * accesses)``), not the rows: what a
    profile task sends and the driver keeps. The histograms of disjoint sets of rows add up (:meth:`merged`)
    to the histogram of their union, so every figure of the report is exact."""

    def __init__(self, counts: np.ndarray, levels: np.ndarray | None = None) -> None:
        """The histogram of per-row ``counts``; with ``levels``, of ``levels[i]`` rows with ``counts[i]`` accesses
        each (a count possibly repeated: the parts of a histogram, concatenated)."""
        if levels is None:
            counts = np.asarray(counts)
            small = counts < _DENSE_COUNTS
            tally = np.bincount(counts[small]) if small.any() else np.zeros(0, dtype=np.int64)
            big, big_rows = np.unique(counts[~small], return_counts=True)
            values = np.flatnonzero(tally)
            self._set(np.concatenate([big[::-1], values[::-1]]),
                      np.concatenate([big_rows[::-1], tally[values][::-1]]))
            return
        counts, levels = np.asarray(counts, dtype=np.int64), np.asarray(levels, dtype=np.int64)
        order = np.argsort(-counts, kind="stable")
        counts, levels = counts[order], levels[order]
        starts = np.flatnonzero(np.concatenate([[True], counts[1:] != counts[:-1]])) if len(counts) else order
        self._set(counts[starts], np.add.reduceat(levels, starts) if len(starts) else levels)

    @classmethod
    def merged(cls, parts: list[CountHistogram]) -> CountHistogram:
        """The histogram of the rows of every part (parts of disjoint rows)."""
        if not parts:
            return cls(np.zeros(0, dtype=np.int64))
        return cls(np.concatenate([p.counts for p in parts]), np.concatenate([p.levels for p in parts]))

    def _set(self, counts: np.ndarray, levels: np.ndarray) -> None:
        """From distinct counts, descending, and the rows of each."""
        keep = levels > 0
        self.counts = counts[keep].astype(np.int64)  # distinct counts, descending
        self.levels = levels[keep].astype(np.int64)  # rows with that count
        self.rows = int(self.levels.sum())
        self.accesses = int((self.counts * self.levels).sum())
        self._cum_rows = np.concatenate([[0], np.cumsum(self.levels)])
        self._cum_acc = np.concatenate([[0], np.cumsum(self.counts * self.levels)])

    @property
    def untouched_rows(self) -> int:
        """Rows with no access."""
        return int(self.levels[-1]) if len(self.counts) and self.counts[-1] == 0 else 0

    def top_accesses(self, k: np.ndarray | int) -> np.ndarray:
        """Accesses taken by the k hottest rows (exact; vectorized over k)."""
        k = np.minimum(np.asarray(k, dtype=np.int64), self.rows)
        level = np.searchsorted(self._cum_rows, k, side="right") - 1
        level = np.minimum(level, len(self.counts) - 1)
        partial = k - self._cum_rows[level]
        count = self.counts[level] if len(self.counts) else 0
        return self._cum_acc[level] + partial * count

    def top_share(self, fraction: float) -> float:
        """Share of accesses taken by the hottest ``ceil(fraction * rows)`` rows."""
        if self.accesses == 0:
            return 0.0
        k = max(1, math.ceil(fraction * self.rows))
        return float(self.top_accesses(k) / self.accesses)


def coverage_curve(hist: CountHistogram, points: int = 121) -> dict[str, list[float]]:
    """(row fraction, access share) at log-spaced row fractions from one row to all rows."""
    if hist.rows == 0 or hist.accesses == 0:
        return {"row_fraction": [], "access_share": []}
    fractions = np.unique(np.concatenate([np.geomspace(1.0 / hist.rows, 1.0, points), [0.001, 0.01, 0.1]]))
    fractions = fractions[fractions >= 1.0 / hist.rows]
    k = np.maximum(1, np.ceil(fractions * hist.rows - 1e-9)).astype(np.int64)
    shares = hist.top_accesses(k) / hist.accesses
    return {"row_fraction": [float(f) for f in fractions], "access_share": [float(s) for s in shares]}


def table_profile(name: str, hist: CountHistogram) -> dict[str, Any]:
    """One table's figures, from its rows' histogram (every row of the table, untouched ones included)."""
    return {
        "table": name,
        "rows": hist.rows,
        "touched_rows": hist.rows - hist.untouched_rows,
        "accesses": hist.accesses,
        "top1pct_rows": max(1, math.ceil(0.01 * hist.rows)),
        "top1pct_share": round(hist.top_share(0.01), 6),
    }


def build_profile(meta: DatasetMeta, dataset_dir: str, per_table: list[CountHistogram]) -> dict[str, Any]:
    """The report from each table's histogram; the whole dataset's is their sum (tables own disjoint rows)."""
    tables = [table_profile(n, h) for n, h in zip(meta.sparse_columns, per_table, strict=True)]
    hist = CountHistogram.merged(per_table)
    return {
        "dataset": str(dataset_dir),
        "fingerprint": meta.fingerprint,
        "samples": meta.rows,
        "total_rows": hist.rows,
        "touched_rows": int(sum(t["touched_rows"] for t in tables)),
        "accesses": hist.accesses,
        "top1pct_rows": max(1, math.ceil(0.01 * hist.rows)),
        "top1pct_share": round(hist.top_share(0.01), 6),
        "top0.1pct_share": round(hist.top_share(0.001), 6),
        "top10pct_share": round(hist.top_share(0.1), 6),
        "tables": tables,
        "coverage": coverage_curve(hist),
    }


def profile_dataset(
    dataset_dir: str | os.PathLike,
    *,
    client: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], list[CountHistogram]]:
    """Count every table's accesses (on Dask when ``client`` is given); return (profile, each table's histogram).

    Tasks count a table, or an id range of a large one (:func:`count_tasks`), and send back only its count
    histogram, so the driver holds histograms, never a count per row. ``progress(done, tables)`` is called as
    each table's last range comes in."""
    dataset_dir = str(Path(dataset_dir).resolve())  # workers may run in another directory
    meta = read_meta(dataset_dir)
    files = [f.name for f in meta.files]
    tasks = count_tasks(meta)
    args = [(dataset_dir, files, meta.sparse_columns[k], lo, hi, meta.cardinalities[k]) for k, lo, hi in tasks]
    ranges_left = [0] * len(meta.sparse_columns)
    for k, _, _ in tasks:
        ranges_left[k] += 1
    parts: list[list[CountHistogram]] = [[] for _ in meta.sparse_columns]
    tables: list[CountHistogram | None] = [None] * len(meta.sparse_columns)

    def counted(i: int, hist: CountHistogram) -> None:
        k = tasks[i][0]
        parts[k].append(hist)
        ranges_left[k] -= 1
        if not ranges_left[k]:
            tables[k], parts[k] = CountHistogram.merged(parts[k]), []
            if progress:
                progress(sum(t is not None for t in tables), len(tables))

    if client is None:
        for i, a in enumerate(args):
            counted(i, count_table(*a))
    else:
        from distributed import as_completed

        futures = [client.submit(count_table, *a, pure=False) for a in args]
        position = {future.key: i for i, future in enumerate(futures)}
        for future, hist in as_completed(futures, with_results=True):
            counted(position[future.key], hist)
            future.release()
    return build_profile(meta, dataset_dir, tables), tables


def write_profile(dataset_dir: str | os.PathLike, profile: dict[str, Any]) -> Path:
    path = Path(dataset_dir) / PROFILE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def plot_coverage(profile: dict[str, Any], path: str | os.PathLike) -> Path:
    """PNG of the coverage curve: share of accesses vs share of rows (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = profile["coverage"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    ax.plot(curve["row_fraction"], curve["access_share"], color="#1f77b4", lw=2, label="all tables")
    ax.axvline(0.01, color="grey", ls="--", lw=1)
    ax.scatter([0.01], [profile["top1pct_share"]], color="#d62728", zorder=3)
    ax.annotate(
        f"top 1% of rows: {100 * profile['top1pct_share']:.1f}% of accesses",
        (0.01, profile["top1pct_share"]), textcoords="offset points", xytext=(8, -18),
    )
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("share of embedding rows (hottest first)")
    ax.set_ylabel("share of accesses")
    ax.set_title(f"Access skew: {profile['samples']:,} samples, {profile['total_rows']:,} rows")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
