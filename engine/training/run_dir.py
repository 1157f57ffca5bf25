"""A checkpointed run directory's names, and the checks of ``dlrmflow resume RUN_DIR`` that need only the
directory: no torch, Dask or Prefect, so that the CLI refuses a directory that cannot be resumed in a
fraction of a second (its ``check``), before the heavy imports. The checks that need the dataset, the
plan or the checkpoint's contents stay in :func:`dlrmflow.engine.training.checkpoint.check_resumable`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dlrmflow.engine.errors import UserInputError

RUN_CONFIG_FILE = "run_config.json"
UNFINISHED_FILE = "UNFINISHED"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"  # run_state.SUMMARY_FILE: that module loads torch, and it is below training/
CHECKPOINT_FORMAT_VERSION = 1  # run_config.json's


class ResumeError(UserInputError):
    """A run directory cannot be resumed, or holds an unfinished run a new run would overwrite."""


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``RUN_DIR/run_config.json``, checked for its format (ResumeError: no such directory, no checkpointed run)."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_CONFIG_FILE
    if not path.is_file():
        if not run_dir.exists():
            raise ResumeError(f"{run_dir} does not exist")
        if not run_dir.is_dir():
            raise ResumeError(f"{run_dir} is a file, not a run directory")
        raise ResumeError(f"{run_dir} has no {RUN_CONFIG_FILE}: nothing to resume (only runs trained with "
                          "--checkpoint-every can be resumed)")
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResumeError(f"{path} is not valid JSON: {exc}") from exc
    if info.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ResumeError(f"{path} has format_version {info.get('format_version')!r}; expected "
                          f"{CHECKPOINT_FORMAT_VERSION}")
    return info


def check_unfinished(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run_config.json of an unfinished run with a checkpoint; ResumeError for every other directory
    (missing, not a run's, a finished run, a run that stopped before its first checkpoint)."""
    run_dir = Path(run_dir)
    info = read_run_config(run_dir)
    if not (run_dir / UNFINISHED_FILE).is_file():
        if (run_dir / SUMMARY_FILE).is_file():
            raise ResumeError(f"{run_dir} holds a finished run ({SUMMARY_FILE} is written): nothing to resume")
        raise ResumeError(f"{run_dir} holds no unfinished run ({UNFINISHED_FILE} is missing): nothing to resume")
    if not (run_dir / CHECKPOINT_FILE).is_file():
        raise ResumeError(f"{run_dir} has no {CHECKPOINT_FILE}: the run stopped before its first checkpoint; "
                          "start it again with `dlrmflow train`")
    return info
