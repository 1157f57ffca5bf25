"""The checks of a run directory that read its checkpoint's iteration or know the final state's files
(torch): what ``dlrmflow train`` refuses to write over, what a resume refuses, and the message that names
``dlrmflow resume RUN_DIR`` after a failure. The checks that need only the directory are
:mod:`.run_directory`'s (no torch: the CLI's early check).

``dlrmflow train`` refuses an ``--output`` holding an unfinished run with a checkpoint (and names the
``dlrmflow resume`` command); a resume refuses a run without a checkpoint, a finished run, a changed dataset
or plan, and a configuration other than the one the run started with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.run_state import ITERATIONS_FILE, STATE_DIR, SUMMARY_FILE
from dlrmflow.engine.training.checkpoint_format import checkpoint_iteration
from dlrmflow.engine.training.run_directory import (
    CHECKPOINT_FILE,
    CHECKPOINT_ROWS_DIR,
    NOT_COMPARED,
    RUN_CONFIG_FILE,
    UNFINISHED_FILE,
    ResumeError,
    check_unfinished,
    comparable_config,
    read_run_config,
    resume_command,
)

# Everything a run writes into its directory before summary.json (the leftovers of a run that stopped).
RUN_FILES = frozenset({STATE_DIR, ITERATIONS_FILE, CHECKPOINT_FILE, CHECKPOINT_ROWS_DIR, RUN_CONFIG_FILE,
                       UNFINISHED_FILE})


def unfinished_run_message(run_dir: str | os.PathLike | None) -> str | None:
    """``RUN_DIR holds an unfinished run (checkpoint at iteration t of n): resume it with ...``, or
    None when ``run_dir`` holds no unfinished run with a checkpoint."""
    if not run_dir:
        return None
    run_dir = Path(run_dir)
    if not (run_dir / UNFINISHED_FILE).is_file():
        return None
    t = checkpoint_iteration(run_dir / CHECKPOINT_FILE)
    if t is None:
        return None  # stopped before its first checkpoint: nothing to lose, nothing to resume
    try:
        n = read_run_config(run_dir)["iterations"]
    except (ResumeError, KeyError):
        n = "?"
    return (f"{run_dir} holds an unfinished run (checkpoint at iteration {t} of {n}): resume it with "
            f"`{resume_command(run_dir)}`")


def refuse_unfinished_run(run_dir: str | os.PathLike) -> None:
    """A new run must not overwrite an unfinished one that can be resumed."""
    message = unfinished_run_message(run_dir)
    if message:
        raise ResumeError(f"{message}, or choose another --output")


def refuse_to_overwrite(run_dir: str | os.PathLike) -> None:
    """A new run (``dlrmflow train``, not a resume) writes only into a directory that is missing, empty,
    or holds the leftovers of a run that stopped before it finished: never over a finished run
    (``summary.json``) nor into a directory holding anything a run does not write. An unfinished run
    with a checkpoint is refused by :func:`refuse_unfinished_run`."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UserInputError(f"--output {run_dir} is a file, not a run directory")
    if (run_dir / SUMMARY_FILE).is_file():
        raise UserInputError(f"{run_dir} holds a finished run ({SUMMARY_FILE} is written); refusing to write over "
                             f"it: choose another --output, or delete {run_dir} to train it again")
    foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_FILES and not p.name.endswith(".tmp"))
    if foreign:
        raise UserInputError(f"--output {run_dir} exists and is not a dlrmflow run directory (it holds "
                             f"{foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); "
                             "refusing to write into it: choose another --output")


def check_resumable(run_dir: str | os.PathLike, config: dict[str, Any], *, dataset_fingerprint: str,
                    plan_fingerprint: str | None, iterations: int) -> int:
    """Every reason not to resume ``run_dir`` with ``config`` (ResumeError); the checkpoint's iteration."""
    run_dir = Path(run_dir)
    info = check_unfinished(run_dir)  # what the CLI's check already refused, for callers without it
    if info["dataset_fingerprint"] != dataset_fingerprint:
        raise ResumeError(
            f"the dataset changed since {run_dir} started (fingerprint {info['dataset_fingerprint'][:12]}…, now "
            f"{dataset_fingerprint[:12]}…): a resumed run would not be the run that started; start a new one "
            "with `dlrmflow train`")
    if info["plan_fingerprint"] != plan_fingerprint:
        raise ResumeError(
            f"the plan changed since {run_dir} started (fingerprint {str(info['plan_fingerprint'])[:12]}…, now "
            f"{str(plan_fingerprint)[:12]}…): start a new run with `dlrmflow train`")
    saved, now = comparable_config(info["config"]), comparable_config(config)
    differ = [k for k in sorted(set(saved) | set(now)) if k not in NOT_COMPARED and saved.get(k) != now.get(k)]
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} (now {now.get(k)!r})" for k in differ)
        raise ResumeError(f"{run_dir} was started with another configuration: {what}; resume it as it started "
                          f"with `{resume_command(run_dir)}`, or start a new run")
    if info["iterations"] != iterations:
        raise ResumeError(f"{run_dir} was started for {info['iterations']} iterations, not {iterations}")
    t = checkpoint_iteration(run_dir / CHECKPOINT_FILE)
    if t is None:
        raise ResumeError(f"{run_dir} has no {CHECKPOINT_FILE}: the run stopped before its first checkpoint; "
                          "start it again with `dlrmflow train`")
    return t
