"""The skew profile of a dataset: how concentrated embedding accesses are.

Every row of every table is an embedding row. Its access count is how many samples use it.
Sorting all rows of all tables by count, the *coverage curve* gives the share of all
accesses taken by the hottest fraction of rows; ``top1pct_share`` is its value at 1% (the
Bagpipe paper reports >92% on Criteo). Counting runs one Dask task per table, each reading only
its column from the Parquet parts.

Curves are computed from the histogram of counts (how many rows have each count), which is
exact and avoids sorting tens of millions of counts.
"""

from __future__ import annotations

import json
import math
import os
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


def count_table(dataset_dir: str, files: list[str], column: str, cardinality: int) -> np.ndarray:
    """Access count of every row of one table (int64 [cardinality])."""
    counts = np.zeros(cardinality, dtype=np.int64)
    for name in files:
        ids = pq.read_table(Path(dataset_dir) / name, columns=[column]).column(0).to_numpy()
        counts += np.bincount(ids, minlength=cardinality)[:cardinality]
    return counts


class CountHistogram:
    """Rows grouped by access count, hottest first: ``levels[i]`` rows have ``counts[i]`` each."""

    def __init__(self, counts: np.ndarray) -> None:
        hist = np.bincount(counts) if len(counts) else np.zeros(1, dtype=np.int64)
        values = np.flatnonzero(hist)[::-1]
        self.counts = values.astype(np.int64)  # distinct counts, descending
        self.levels = hist[values].astype(np.int64)  # rows with that count
        self.rows = int(self.levels.sum())
        self.accesses = int((self.counts * self.levels).sum())
        self._cum_rows = np.concatenate([[0], np.cumsum(self.levels)])
        self._cum_acc = np.concatenate([[0], np.cumsum(self.counts * self.levels)])

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


def table_profile(name: str, counts: np.ndarray) -> dict[str, Any]:
    hist = CountHistogram(counts)
    return {
        "table": name,
        "rows": int(len(counts)),
        "touched_rows": int(np.count_nonzero(counts)),
        "accesses": hist.accesses,
        "top1pct_rows": max(1, math.ceil(0.01 * len(counts))),
        "top1pct_share": round(hist.top_share(0.01), 6),
    }


def build_profile(meta: DatasetMeta, dataset_dir: str, per_table_counts: list[np.ndarray]) -> dict[str, Any]:
    tables = [table_profile(n, c) for n, c in zip(meta.sparse_columns, per_table_counts, strict=True)]
    hist = CountHistogram(np.concatenate(per_table_counts) if per_table_counts else np.zeros(0, np.int64))
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
    client=None,
    progress=None,
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Count every table's accesses (on Dask when ``client`` is given); return (profile, counts)."""
    dataset_dir = str(Path(dataset_dir).resolve())  # workers may run in another directory
    meta = read_meta(dataset_dir)
    files = [f.name for f in meta.files]
    jobs = list(zip(meta.sparse_columns, meta.cardinalities, strict=True))
    counts: list[np.ndarray] = []
    if client is None:
        for i, (col, card) in enumerate(jobs):
            counts.append(count_table(dataset_dir, files, col, card))
            if progress:
                progress(i + 1, len(jobs))
    else:
        from distributed import as_completed

        futures = [client.submit(count_table, dataset_dir, files, col, card, pure=False) for col, card in jobs]
        for i, _ in enumerate(as_completed(futures)):
            if progress:
                progress(i + 1, len(jobs))
        counts = client.gather(futures)
    return build_profile(meta, dataset_dir, counts), counts


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
