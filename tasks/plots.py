"""PNG plots of a training run (matplotlib, Agg backend: no display needed).

:func:`plot_loss` and :func:`plot_iteration_time` read the run's per-iteration log (iterations.csv:
iteration, loss, iteration_ms, stall_ms) and mark injected kills, so a slow iteration can be read
against the failure that caused it; :func:`plot_loss` also draws the held-out log loss of the run's
evaluations (summary.json's ``evaluations``: every ``--eval-every`` iterations and at the end).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np

LOSS_PLOT = "loss.png"
TIME_PLOT = "iteration_time.png"


def read_iterations(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """iterations.csv as columns: ``iteration`` (int), ``loss``, ``iteration_ms``, ``stall_ms`` (float)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = {name: np.array([float(r[name]) for r in rows]) for name in ("loss", "iteration_ms", "stall_ms")}
    columns["iteration"] = np.array([int(r["iteration"]) for r in rows], dtype=np.int64)
    return columns


def moving_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of each value and up to ``window - 1`` before it (as long as the input)."""
    if len(values) == 0:
        return values
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark_kills(ax, kills: list[dict[str, Any]]) -> None:
    for n, kill in enumerate(kills):
        at = int(kill["kill"].rsplit("@", 1)[1])
        ax.axvline(at, color="red", ls=":", lw=1.2, label="kill" if n == 0 else None)


def plot_loss(columns: dict[str, np.ndarray], path: str | os.PathLike, *, title: str,
              kills: list[dict[str, Any]] | None = None, evaluations: list[dict[str, Any]] | None = None) -> Path:
    """Training loss per iteration and its moving mean (window: a tenth of the run, at least 5); with
    ``evaluations`` ({iteration, auc, logloss}), the held-out log loss as a curve of points on the same axis
    (both are the mean log loss, so they read against each other)."""
    plt = _pyplot()
    it, loss = columns["iteration"], columns["loss"]
    window = max(5, len(it) // 10)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(it, loss, color="#9ecae1", lw=1, label="batch loss")
    ax.plot(it, moving_mean(loss, window), color="#08519c", lw=2, label=f"mean of the last {window}")
    held_out = [e for e in evaluations or [] if e.get("logloss") is not None]
    if held_out:
        ax.plot([e["iteration"] for e in held_out], [e["logloss"] for e in held_out], color="#d95f0e", lw=1.5,
                marker="o", ms=4, label="held-out log loss")
    ax.set_ylabel("training loss (log loss)")
    return _finish_run_plot(plt, fig, ax, path, title=title, kills=kills)


def plot_iteration_time(columns: dict[str, np.ndarray], path: str | os.PathLike, *, title: str,
                        kills: list[dict[str, Any]] | None = None) -> Path:
    """Iteration time per iteration (ms) with the part spent stalled on embedding rows shaded."""
    plt = _pyplot()
    it, ms, stall = columns["iteration"], columns["iteration_ms"], columns["stall_ms"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(it, ms, color="#31a354", lw=1.2, label="iteration time")
    share = 100 * stall.sum() / ms.sum() if ms.sum() > 0 else 0.0
    ax.fill_between(it, 0, np.minimum(stall, ms), color="#fd8d3c", alpha=0.6,
                    label=f"of which stalled on embedding rows ({share:.1f}% in all)")
    ax.set_ylabel("time (ms)")
    ax.set_ylim(bottom=0)
    return _finish_run_plot(plt, fig, ax, path, title=title, kills=kills)


def _finish_run_plot(plt, fig, ax, path: str | os.PathLike, *, title: str,
                     kills: list[dict[str, Any]] | None) -> Path:
    """What every per-iteration plot of a run shares: kill markers, axis, title, legend, the PNG."""
    _mark_kills(ax, kills or [])
    ax.set_xlabel("iteration")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
