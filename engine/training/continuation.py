"""Starting from a finished run: ``dlrmflow train --init-from RUN_DIR`` and ``dlrmflow evaluate RUN_DIR``.

The daily loop trains today's data from yesterday's model. Yesterday's dataset and today's share ids
(today's vocabulary grew from yesterday's: ``dlrmflow preprocess --vocabulary``), so a row of the finished
run is the row of the same id today: table ``k``'s row ``i`` is global id ``offsets[k] + i`` in either
layout, with each layout's own offsets. The continued run starts

- its dense parameters and the dense optimizer's state from the run's ``final_state/dense.pt``;
- every row the run had from the run's final rows, read by id from its shard files by the process that
  holds the row (:class:`~dlrmflow.engine.serving.embedding_rows.StartingRows`): no process gathers them;
- every row new in today's vocabulary as usual, from its hash
  (:func:`~dlrmflow.engine.serving.embedding_rows.init_rows`);
- its learning-rate schedule at the run's step count (``steps_before``: the run's iterations and those of
  the runs it continued).

So day 0, then day 1 continued from it, ends bit-identical to one run over day 0's batches then day 1's.

This module loads no torch: the CLI checks the run directory with :func:`read_finished_run` before the
heavy imports. Refused, naming the problem: a directory that holds no finished run (missing, unfinished,
no final state), another model or architecture, other row widths or optimizers, and a run on data whose
ids this dataset's do not keep.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import ADDED_ARCHITECTURE
from dlrmflow.engine.training.run_directory import SUMMARY_FILE, UNFINISHED_FILE

STATE_DIR = "final_state"  # run_state.STATE_DIR (that module loads torch)
MANIFEST_FILE = "manifest.json"


class InitFromError(UserInputError):
    """A run cannot be continued from (or evaluated): it names the run and what does not fit."""


@dataclass(frozen=True)
class FinishedRun:
    """A finished run's directory, checked: its summary and its final state's manifest."""

    run_dir: str
    summary: dict[str, Any]
    manifest: dict[str, Any]

    @property
    def state_dir(self) -> str:
        return str(Path(self.run_dir) / STATE_DIR)

    @property
    def steps(self) -> int:
        """Optimizer steps the run's state has taken: its iterations, and those of the runs it continued."""
        continued = self.summary["init_from"]
        return int(self.summary["iterations"]) + (0 if continued is None else int(continued["steps_before"]))

    def starting_rows(self, cardinalities: list[int]) -> Any:
        """The run's final rows for a layout whose tables held ``cardinalities`` rows in the run's dataset."""
        from dlrmflow.engine.serving.embedding_rows import StartingRows  # torch: not in the CLI's early check

        return StartingRows(self.state_dir, tuple(int(c) for c in cardinalities), int(self.manifest["width"]),
                            str(self.manifest["state_sha256"]))


def read_finished_run(run_dir: str | os.PathLike, *, option: str = "--init-from") -> FinishedRun:
    """``run_dir`` as a finished run with a final state; InitFromError naming what is missing."""
    path = Path(run_dir).resolve()
    where = f"{option} {run_dir}"
    if not path.exists():
        raise InitFromError(f"{where}: no such run directory")
    if not path.is_dir():
        raise InitFromError(f"{where} is a file, not a run directory")
    if (path / UNFINISHED_FILE).is_file():
        raise InitFromError(f"{where} holds an unfinished run: finish it first (`dlrmflow resume {run_dir}`)")
    if not (path / SUMMARY_FILE).is_file():
        raise InitFromError(f"{where} holds no finished run ({SUMMARY_FILE} is missing)")
    manifest_path = path / STATE_DIR / MANIFEST_FILE
    if not manifest_path.is_file():
        raise InitFromError(f"{where} has no {STATE_DIR}/{MANIFEST_FILE}: the run kept no final state (trained "
                            "without save_state)")
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text())
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise InitFromError(f"{where}: a file of the run is not valid JSON ({exc})") from None
    return FinishedRun(str(path), summary, manifest)


def parent_cardinalities(run: FinishedRun, meta: Any, where: str) -> list[int]:
    """The table sizes of the dataset ``run`` trained on, from ``meta``'s vocabulary lineage; InitFromError
    when ``meta``'s ids do not keep that dataset's."""
    fingerprint = run.summary["dataset_fingerprint"]
    if fingerprint == meta.fingerprint:
        cards = list(meta.cardinalities)
    else:
        entries = [e for e in (meta.vocabulary or {}).get("lineage") or [] if e["fingerprint"] == fingerprint]
        if not entries:
            raise InitFromError(
                f"{where} trained on the dataset {run.summary['dataset']} (fingerprint {fingerprint[:12]}), "
                f"and this dataset's vocabulary does not descend from it: its ids would mean other values "
                "(preprocess the new day with `--vocabulary` that dataset, or a dataset made from it)")
        cards = list(entries[-1]["cardinalities"])
    if sum(cards) != int(run.manifest["total_rows"]):
        raise InitFromError(f"{where}: its final state holds {run.manifest['total_rows']} rows, its dataset "
                            f"{sum(cards)}: the run directory does not match its summary")
    return cards


def check_init_from(run: FinishedRun, *, config: Any, embedding_optimizer: str, meta: Any,
                    architecture: dict[str, Any], row_width: int, width: int, layout: str) -> Any:
    """The finished run ``config.init_from`` names (``run``), checked against this run's model (``architecture``,
    as a summary records it), optimizers (``embedding_optimizer``: ``config``'s resolved), row layout
    (``row_width`` weights, ``width`` values with the optimizer state, ``layout`` in words:
    RowSpec.describe_layout) and dataset (``meta``); the rows it starts from."""
    where = f"--init-from {config.init_from}"
    summary = run.summary
    if summary["model"] != config.model:
        raise InitFromError(f"model: {where} trained --model {summary['model']}, this run is --model {config.model}")
    if summary["row_width"] != row_width:
        raise InitFromError(f"embedding_dim: {where} has rows of {summary['row_width']} weights, this run "
                            f"{row_width}")
    # A run recorded before a field of this run's architecture existed was built as ADDED_ARCHITECTURE says.
    theirs = {**{k: v for k, v in ADDED_ARCHITECTURE.items() if k in architecture}, **summary["architecture"]}
    for key in sorted(set(theirs) | set(architecture)):
        if theirs.get(key) != architecture.get(key):
            raise InitFromError(f"{key}: {where} has {key} {theirs.get(key)}, this run {architecture.get(key)}")
    for key, ours in (("embedding_optimizer", embedding_optimizer), ("dense_optimizer", config.dense_optimizer)):
        if summary[key] != ours:
            raise InitFromError(f"{key}: {where} trained with --{key.replace('_', '-')} {summary[key]}, this run "
                                f"{ours} (the optimizer state would not fit)")
    theirs_width = int(run.manifest["width"])
    if theirs_width != width:
        # Same model, weights and optimizer: the optimizer state is laid out otherwise (a final state written
        # before the model's first-order weights kept accumulators of their own). Its values cannot be split.
        state = theirs_width - row_width
        raise InitFromError(f"embedding_optimizer: {where} stores rows of {theirs_width} values ({row_width} "
                            f"weights, then {state} optimizer value{'' if state == 1 else 's'}), this version "
                            f"{width} ({layout}): the run was trained by a dlrmflow with another row layout; "
                            "continue it with that version, or train it again with this one")
    cards = parent_cardinalities(run, meta, where)
    return run.starting_rows(cards)


def init_from_record(run: FinishedRun) -> dict[str, Any]:
    """What summary.json says of the run a run continued: the directory, its state SHA-256, its steps."""
    return {"run_dir": run.run_dir, "state_sha256": run.summary["state_sha256"], "steps_before": run.steps}
